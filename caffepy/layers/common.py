"""Common layers: InnerProduct, Concat, Slice, Split, Eltwise, Flatten, Reshape, Scale,
Bias, Softmax, ArgMax, Tile, Embed, Silence, Reduction."""
from ..layer import Layer, register


@register
class Split(Layer):
    """Copy one bottom to every top; backward sums the top diffs (inserted by the Net
    where a blob feeds several layers)."""
    exact_bottoms = 1
    min_tops = 1
    accepts_blocked = True

    def reshape(self, bottom, top):
        for t in top:
            t.reshape(bottom[0].shape)

    def forward(self, bottom, top):
        for t in top:
            t.data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        diff = bottom[0].diff
        diff[...] = top[0].diff
        for t in top[1:]:
            diff += t.diff
