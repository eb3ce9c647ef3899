import numpy as np
import pytest

from caffepy.blob import Blob
from caffepy.context import RunContext
from caffepy.errors import LayerError, ShapeError
from caffepy.layer import MODEL_PARALLEL
from layer_cases import Case, case_tests, make_layer, randn, setup_layer


def softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def comm_self():
    from mpi4py import MPI
    return RunContext(rank=0, size=1, comm=MPI.COMM_SELF)


def ip_ref(x, layer, axis=1, transpose=False):
    w = layer.blobs[0].data.astype(np.float64)
    x2 = x.reshape(int(np.prod(x.shape[:axis])), -1)
    y = x2 @ (w if transpose else w.T)
    if len(layer.blobs) > 1:
        y = y + layer.blobs[1].data
    return [y.reshape(x.shape[:axis] + (y.shape[1],))]


def separated(n_bottoms, *shape, seed=0):
    """Bottoms whose values all differ by at least 0.1 (no near-ties for MAX / ArgMax)."""
    count = int(np.prod(shape))
    values = np.random.default_rng(seed).permutation(n_bottoms * count).astype(np.float32) * 0.1 - count * 0.05
    return [v.reshape(shape) for v in np.split(values, n_bottoms)]


def eltwise_max_ref(*xs):
    return [np.max(np.stack(xs), axis=0)]


def broadcast(v, x_ndim, axis):
    """v lined up with an x of x_ndim axes from `axis`, with ones elsewhere."""
    return v.reshape((1,) * axis + v.shape + (1,) * (x_ndim - axis - v.ndim))


def scale_ref(axis, with_bias=False):
    def ref(x, *rest, layer):
        s = rest[0] if rest else layer.blobs[0].data.astype(np.float64)
        y = x * broadcast(s, x.ndim, axis if s.ndim else 0)
        if with_bias:
            y = y + broadcast(layer.blobs[-1].data.astype(np.float64), x.ndim, axis if s.ndim else 0)
        return [y]
    return ref


def bias_ref(axis):
    def ref(x, *rest, layer):
        b = rest[0] if rest else layer.blobs[0].data.astype(np.float64)
        return [x + broadcast(b, x.ndim, axis if b.ndim else 0)]
    return ref


def argmax_ref(x, k, out_max_val=False, axis=None):
    """Indices of the k largest, larger index first on ties (Caffe's pair sort)."""
    if axis is None:
        flat = x.reshape(x.shape[0], -1)
        order = np.array([sorted(range(flat.shape[1]), key=lambda j: (flat[i, j], j), reverse=True)[:k]
                          for i in range(flat.shape[0])])
        vals = np.take_along_axis(flat, order, axis=1)
        out = np.stack([order, vals], axis=1) if out_max_val else order[:, None, :]
        return out.reshape(out.shape + (1,) * (x.ndim - 3)) if x.ndim > 3 else out
    moved = np.moveaxis(x, axis, -1)
    order = np.argsort(-moved[..., ::-1], axis=-1, kind="stable")[..., :k]
    order = moved.shape[-1] - 1 - order
    res = np.take_along_axis(moved, order, axis=-1) if out_max_val else order
    return np.moveaxis(res, -1, axis)


GAUSS = "weight_filler { type: 'gaussian' std: 0.5 } bias_filler { type: 'gaussian' std: 0.5 }"
X4 = randn(2, 3, 4, 5)
IDX = np.array([[0, 3, 5], [5, 1, 0]], np.float32)
SEP3 = separated(3, 2, 3, 4)
SEP1 = separated(1, 3, 4, 5, seed=3)[0]

CASES = [
    Case("Split", "", [randn(2, 3, 4)], n_top=3, expected=lambda x: [x, x, x]),
    # InnerProduct
    Case("InnerProduct", f"inner_product_param {{ num_output: 4 {GAUSS} }}", [X4[:, :, :2, :2]],
         expected=lambda x, layer: ip_ref(x, layer)),
    Case("InnerProduct", f"inner_product_param {{ num_output: 3 transpose: true {GAUSS} }}", [randn(4, 6)],
         expected=lambda x, layer: ip_ref(x, layer, transpose=True)),
    Case("InnerProduct", f"inner_product_param {{ num_output: 9 {GAUSS} }}", [X4[:, :, :2, :2]],
         expected=lambda x, layer: ip_ref(x, layer)),
    # few rows against many outputs and inputs: y^T = W x^T and dx^T = W^T dy^T, a batch item
    # a column (skinny_gemm), here with padding columns and a tail of rows
    Case("InnerProduct", f"inner_product_param {{ num_output: 37 {GAUSS} }}", [randn(9, 40)],
         expected=lambda x, layer: ip_ref(x, layer)),
    Case("InnerProduct", f"inner_product_param {{ num_output: 3 axis: 2 bias_term: false {GAUSS} }}",
         [randn(2, 3, 4)], expected=lambda x, layer: ip_ref(x, layer, axis=2)),
    Case("InnerProduct", f"inner_product_param {{ num_output: 2 axis: -1 transpose: true {GAUSS} }}",
         [randn(3, 2, 5)], expected=lambda x, layer: ip_ref(x, layer, axis=2, transpose=True)),
    # the model-parallel variant (caffepy/parallel) over a real communicator of one rank;
    # tests/test_mpi_train.py runs it on several
    Case("InnerProduct", f"inner_product_param {{ num_output: 4 {GAUSS} }}", [X4[:, :, :2, :2]],
         variant=MODEL_PARALLEL, context=comm_self, expected=lambda x, layer: ip_ref(x, layer)),
    Case("InnerProduct", f"inner_product_param {{ num_output: 3 axis: 2 bias_term: false {GAUSS} }}",
         [randn(2, 3, 4)], variant=MODEL_PARALLEL, context=comm_self,
         expected=lambda x, layer: ip_ref(x, layer, axis=2)),
    # Concat / Slice
    Case("Concat", "", [randn(2, 3, 4), randn(2, 1, 4, seed=1), randn(2, 2, 4, seed=2)],
         expected=lambda *xs: [np.concatenate(xs, axis=1)]),
    Case("Concat", "concat_param { axis: -1 }", [randn(2, 3), randn(2, 5, seed=1)],
         expected=lambda *xs: [np.concatenate(xs, axis=1)]),
    Case("Concat", "concat_param { concat_dim: 0 }", [randn(2, 3), randn(1, 3, seed=1)],
         expected=lambda *xs: [np.concatenate(xs, axis=0)]),
    # Intel's per_fla_fuse: each bottom as Permute (0, 2, 3, 1) + Flatten, joined on axis 1
    Case("Concat", "concat_param { axis: 1 per_fla_fuse: true }",
         [randn(2, 3, 2, 2), randn(2, 2, 1, 3, seed=1)],
         expected=lambda *xs: [np.concatenate([x.transpose(0, 2, 3, 1).reshape(2, -1) for x in xs],
                                              axis=1).reshape(2, 18, 1, 1)]),
    # on another axis Intel ignores it
    Case("Concat", "concat_param { axis: 2 per_fla_fuse: true }", [randn(2, 3, 2), randn(2, 3, 1, seed=1)],
         expected=lambda *xs: [np.concatenate(xs, axis=2)]),
    Case("Slice", "slice_param { slice_point: 1 slice_point: 4 }", [randn(2, 6, 3)], n_top=3,
         expected=lambda x: [x[:, :1], x[:, 1:4], x[:, 4:]]),
    Case("Slice", "slice_param { axis: -1 }", [randn(2, 3, 6)], n_top=2,
         expected=lambda x: [x[..., :3], x[..., 3:]]),
    Case("Slice", "slice_param { slice_dim: 0 slice_point: 3 }", [randn(4, 2)], n_top=2,
         expected=lambda x: [x[:3], x[3:]]),
    # Eltwise
    Case("Eltwise", "", [randn(2, 3, 4), randn(2, 3, 4, seed=1)], expected=lambda a, b: [a + b]),
    Case("Eltwise", "eltwise_param { operation: SUM coeff: 0.5 coeff: -2 coeff: 1 }",
         [randn(2, 3), randn(2, 3, seed=1), randn(2, 3, seed=2)],
         expected=lambda a, b, c: [0.5 * a - 2 * b + c]),
    Case("Eltwise", "eltwise_param { operation: PROD }", [randn(2, 3, 4), randn(2, 3, 4, seed=1),
                                                          randn(2, 3, 4, seed=2)],
         expected=lambda a, b, c: [a * b * c]),
    Case("Eltwise", "eltwise_param { operation: PROD stable_prod_grad: false }",
         [randn(2, 3) + 3, randn(2, 3, seed=1) - 3], expected=lambda a, b: [a * b]),
    Case("Eltwise", "eltwise_param { operation: MAX }", SEP3, expected=eltwise_max_ref),
    # Flatten / Reshape
    Case("Flatten", "", [X4], expected=lambda x: [x.reshape(2, -1)]),
    Case("Flatten", "flatten_param { axis: 1 end_axis: 2 }", [X4], expected=lambda x: [x.reshape(2, 12, 5)]),
    Case("Flatten", "flatten_param { axis: -2 }", [X4], expected=lambda x: [x.reshape(2, 3, 20)]),
    Case("Reshape", "reshape_param { shape { dim: 0 dim: -1 dim: 10 } }", [X4],
         expected=lambda x: [x.reshape(2, 6, 10)]),
    Case("Reshape", "reshape_param { shape { dim: 2 dim: 2 } axis: 1 num_axes: 2 }", [randn(2, 4, 1, 3)],
         expected=lambda x: [x.reshape(2, 2, 2, 3)]),
    Case("Reshape", "reshape_param { shape { dim: 1 dim: -1 } axis: -1 }", [randn(2, 3)],
         expected=lambda x: [x.reshape(2, 3, 1, 1)]),
    # Scale / Bias
    Case("Scale", "scale_param { filler { type: 'gaussian' } }", [X4], expected=scale_ref(1)),
    Case("Scale", "scale_param { axis: 1 num_axes: 2 bias_term: true filler { type: 'gaussian' } "
                  "bias_filler { type: 'gaussian' } }", [X4], expected=scale_ref(1, True)),
    Case("Scale", "scale_param { num_axes: 0 filler { type: 'constant' value: 1.5 } }", [X4],
         expected=scale_ref(1)),
    Case("Scale", "scale_param { axis: 2 num_axes: -1 filler { type: 'gaussian' } }", [X4],
         expected=scale_ref(2)),
    Case("Scale", "scale_param { axis: 0 }", [randn(2, 3, 4), randn(2, 3, seed=1)], expected=scale_ref(0)),
    Case("Scale", "scale_param { axis: -1 bias_term: true bias_filler { type: 'gaussian' } }",
         [randn(2, 3, 4), randn(4, seed=1)], expected=scale_ref(2, True)),
    Case("Bias", "bias_param { filler { type: 'gaussian' } }", [X4], expected=bias_ref(1)),
    Case("Bias", "bias_param { axis: 2 num_axes: 2 filler { type: 'gaussian' } }", [X4], expected=bias_ref(2)),
    Case("Bias", "bias_param { axis: 1 }", [randn(2, 3, 4), randn(3, 4, seed=1)], expected=bias_ref(1)),
    # Softmax
    Case("Softmax", "", [X4 * 3], expected=lambda x: [softmax(x, 1)]),
    Case("Softmax", "softmax_param { axis: -1 }", [randn(3, 7)], expected=lambda x: [softmax(x, 1)]),
    Case("Softmax", "", [np.array([[1000, 0, -1000], [-50, 50, 49]], np.float32)], id="Softmax:huge", grad=False,
         expected=lambda x: [softmax(x, 1)]),
    # ArgMax (no gradient)
    Case("ArgMax", "", [SEP1], grad=False, expected=lambda x: [argmax_ref(x, 1)]),
    Case("ArgMax", "argmax_param { top_k: 3 out_max_val: true }", [SEP1], grad=False,
         expected=lambda x: [argmax_ref(x, 3, True)]),
    Case("ArgMax", "argmax_param { top_k: 2 }", [separated(1, 2, 3, 2, 2)[0]], grad=False,
         expected=lambda x: [argmax_ref(x, 2)]),
    Case("ArgMax", "argmax_param { axis: 1 top_k: 2 }", [SEP1], grad=False,
         expected=lambda x: [argmax_ref(x, 2, axis=1)]),
    Case("ArgMax", "argmax_param { axis: -1 out_max_val: true }", [SEP1], grad=False,
         expected=lambda x: [argmax_ref(x, 1, True, axis=2)]),
    Case("ArgMax", "argmax_param { top_k: 2 }", [np.array([[1, 3, 3, 0], [2, 2, 2, 2]], np.float32)],
         id="ArgMax:ties", grad=False, expected=lambda x: [np.array([[[2, 1]], [[3, 2]]], np.float64)]),
    # Tile / Embed / Silence / Reduction
    Case("Tile", "tile_param { tiles: 3 }", [randn(2, 3, 2)], expected=lambda x: [np.tile(x, (1, 3, 1))]),
    Case("Tile", "tile_param { axis: -1 tiles: 2 }", [randn(2, 3)], expected=lambda x: [np.tile(x, (1, 2))]),
    Case("Tile", "tile_param { axis: 0 tiles: 2 }", [randn(2, 3)], expected=lambda x: [np.tile(x, (2, 1))]),
    Case("Embed", "embed_param { num_output: 4 input_dim: 6 weight_filler { type: 'gaussian' } "
                  "bias_filler { type: 'gaussian' } }", [IDX], check_bottom=[],
         expected=lambda x, layer: [layer.blobs[0].data[x.astype(int)] + layer.blobs[1].data]),
    Case("Embed", "embed_param { num_output: 3 input_dim: 4 bias_term: false weight_filler { type: 'gaussian' } }",
         [np.array([3, 3, 1], np.float32)], check_bottom=[],
         expected=lambda x, layer: [layer.blobs[0].data[x.astype(int)]]),
    Case("Silence", "", [randn(2, 3), randn(4, seed=1)], n_top=0, expected=lambda a, b: []),
    Case("Reduction", "", [X4], expected=lambda x: [np.array(x.sum())]),
    Case("Reduction", "reduction_param { operation: ASUM axis: 1 coeff: 2 }", [X4],
         expected=lambda x: [2 * np.abs(x).sum(axis=(1, 2, 3))], kink=0.0, kink_range=0.02),
    Case("Reduction", "reduction_param { operation: SUMSQ axis: -1 }", [X4],
         expected=lambda x: [(x * x).sum(axis=-1)]),
    Case("Reduction", "reduction_param { operation: MEAN axis: 2 coeff: -0.5 }", [X4],
         expected=lambda x: [-0.5 * x.mean(axis=(2, 3))]),
    # BatchReindex / Filter / Parameter
    Case("BatchReindex", "", [randn(4, 3, 2), np.array([3, 0, 3, 1, 2], np.float32)], check_bottom=[0],
         expected=lambda x, idx: [x[idx.astype(int)]]),
    Case("BatchReindex", "", [randn(3, 2), np.array([2.7, 0], np.float32)], check_bottom=[0],
         expected=lambda x, idx: [x[[2, 0]]], id="BatchReindex:truncates"),
    Case("Filter", "", [randn(4, 3), randn(4, 2, 2, seed=1), np.array([1, 0, 0.5, 1], np.float32)], n_top=2,
         check_bottom=[0, 1], expected=lambda a, b, sel: [a[[0, 2, 3]], b[[0, 2, 3]]]),
    Case("Filter", "", [randn(3, 2), np.array([[0], [1], [0]], np.float32)], check_bottom=[0],
         expected=lambda a, sel: [a[[1]]], id="Filter:N x 1 selector"),
    Case("Parameter", "parameter_param { shape { dim: 2 dim: 3 } }", [],
         init=lambda layer: layer.blobs[0].set_data(randn(2, 3, seed=4)),
         expected=lambda layer: [layer.blobs[0].data]),
]

test_forward, test_gradient = case_tests(CASES)


# -- behaviour beyond the forward/gradient cases -----------------------------------------------
def _blob(a, name="b"):
    b = Blob(name=name)
    b.set_data(a)
    return b


def test_inner_product_param_diffs_accumulate():
    layer, bottom, top = setup_layer("InnerProduct", f"inner_product_param {{ num_output: 3 {GAUSS} }}",
                                     [randn(4, 5)])
    layer.forward(bottom, top)
    top[0].diff[...] = randn(4, 3, seed=1)
    for p in layer.blobs:
        p.diff[...] = 1
    layer.backward(top, [True], bottom)
    dy, x = top[0].diff.astype(np.float64), bottom[0].data.astype(np.float64)
    np.testing.assert_allclose(layer.blobs[0].diff, 1 + dy.T @ x, rtol=1e-5)
    np.testing.assert_allclose(layer.blobs[1].diff, 1 + dy.sum(0), rtol=1e-5)
    np.testing.assert_allclose(bottom[0].diff, dy @ layer.blobs[0].data, rtol=1e-5)


def test_inner_product_honours_param_propagate_down():
    layer, bottom, top = setup_layer("InnerProduct", f"inner_product_param {{ num_output: 3 {GAUSS} }}",
                                     [randn(4, 5)])
    layer.param_propagate_down = [False, True]
    layer.forward(bottom, top)
    top[0].diff[...] = 1
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, [False], bottom)
    assert not layer.blobs[0].diff.any() and layer.blobs[1].diff.all()


def test_flatten_and_reshape_share_data_and_diff():
    for type_, params in [("Flatten", ""), ("Reshape", "reshape_param { shape { dim: -1 } }")]:
        layer, bottom, top = setup_layer(type_, params, [X4])
        layer.forward(bottom, top)
        assert np.shares_memory(top[0].data, bottom[0].data)
        top[0].diff[...] = 7
        layer.backward(top, [True], bottom)
        assert np.shares_memory(top[0].diff, bottom[0].diff)
        assert (bottom[0].diff == 7).all() and bottom[0].diff.shape == X4.shape


@pytest.mark.parametrize("layout", [None, "nhwc"])
def test_split_tops_share_the_bottom_data_and_sum_their_diffs(layout):
    """As Caffe's Split: no copy forward (the tops are the bottom's data, in its layout, after
    every reshape), the diffs summed backward."""
    from caffepy.blob import CHANNELS_LAST
    layer, bottom, top = setup_layer("Split", "", [X4], n_top=3)
    if layout:
        bottom[0].layout = CHANNELS_LAST
        layer.reshape(bottom, top)
    for grow in (False, True):
        if grow:                            # a new, larger bottom buffer: the tops follow it
            bottom[0].reshape(3, *X4.shape[1:])
            layer.reshape(bottom, top)
        bottom[0].data[...] = randn(*bottom[0].shape, seed=4)
        layer.forward(bottom, top)
        for i, t in enumerate(top):
            assert t.layout == bottom[0].layout
            assert np.shares_memory(t.raw_data, bottom[0].raw_data)
            np.testing.assert_array_equal(t.data, bottom[0].data)
            t.diff[...] = i + 1.0
        layer.backward(top, [True], bottom)
        assert (bottom[0].diff == 6.0).all()


@pytest.mark.parametrize("type_,params", [
    ("Scale", "scale_param { bias_term: true filler { type: 'gaussian' } bias_filler { type: 'gaussian' } }"),
    ("Bias", "bias_param { filler { type: 'gaussian' } }"),
])
def test_scale_and_bias_in_place(type_, params):
    dy = randn(2, 3, 4, 5, seed=9)
    results = []
    for in_place in (False, True):
        layer = make_layer(type_, params)
        b = _blob(X4)
        t = b if in_place else Blob()
        from caffepy import rng
        rng.seed(3)
        layer.layer_setup([b], [t])
        layer.forward([b], [t])
        y = t.data.copy()
        t.diff[...] = dy
        for p in layer.blobs:
            p.diff[...] = 0
        layer.backward([t], [True], [b])
        results.append((y, b.diff.copy(), [p.diff.copy() for p in layer.blobs]))
    (y0, d0, p0), (y1, d1, p1) = results
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_allclose(d1, d0, rtol=1e-6)
    for a, c in zip(p1, p0):
        np.testing.assert_allclose(a, c, rtol=1e-5)


def test_scale_blobs_layout():
    layer, _, _ = setup_layer("Scale", "scale_param { bias_term: true }", [X4])
    assert [p.shape for p in layer.blobs] == [(3,), (3,)]
    assert (layer.blobs[0].data == 1).all() and (layer.blobs[1].data == 0).all()
    layer, _, _ = setup_layer("Scale", "scale_param { bias_term: true }", [X4, randn(3, 4)])
    assert [p.shape for p in layer.blobs] == [(3, 4)]
    layer, _, _ = setup_layer("Scale", "", [X4, randn(3, 4)])
    assert layer.blobs == []


def test_eltwise_max_backward_routes_to_the_winner():
    a = np.array([1, 5, 2, 2], np.float32)
    b = np.array([3, 4, 2, 1], np.float32)
    c = np.array([0, 6, 2, 9], np.float32)
    layer, bottom, top = setup_layer("Eltwise", "eltwise_param { operation: MAX }", [a, b, c])
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, [3, 6, 2, 9])
    top[0].diff[...] = 1
    layer.backward(top, [True, True, True], bottom)
    # a tie between bottom 0 and 1 goes to bottom 1; a later tie stays with the earlier winner
    np.testing.assert_array_equal(np.stack([b_.diff for b_ in bottom]),
                                  [[0, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]])


def test_silence_zeroes_bottom_diffs():
    layer, bottom, top = setup_layer("Silence", "", [randn(2, 3), randn(4)], n_top=0)
    for b in bottom:
        b.diff[...] = 5
    layer.backward(top, [True, False], bottom)
    assert not bottom[0].diff.any() and (bottom[1].diff == 5).all()


def test_embed_repeated_indices_accumulate():
    layer, bottom, top = setup_layer("Embed", "embed_param { num_output: 2 input_dim: 3 bias_term: false }",
                                     [np.array([1, 1, 2], np.float32)])
    layer.forward(bottom, top)
    top[0].diff[...] = [[1, 2], [3, 4], [5, 6]]
    layer.blobs[0].diff[...] = 0
    layer.backward(top, [False], bottom)
    np.testing.assert_array_equal(layer.blobs[0].diff, [[0, 0], [4, 6], [5, 6]])


def _error(type_, params, bottoms, n_top=1):
    with pytest.raises(LayerError) as info:
        setup_layer(type_, params, bottoms, n_top=n_top)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"layer 'layer' ({type_}): ")
    return msg


def test_errors_name_the_layer_and_the_values():
    msg = _error("Concat", "", [randn(2, 3, 4), randn(2, 3, 5)])
    assert "bottom[1]" in msg and "2x3x4" in msg and "2x3x5" in msg
    msg = _error("Reshape", "reshape_param { shape { dim: -1 dim: -1 } }", [X4])
    assert "reshape_param.shape: at most one dimension may be -1, got [-1, -1]" in msg
    msg = _error("Reshape", "reshape_param { shape { dim: 7 dim: -1 } }", [X4])
    assert "cannot infer -1" in msg
    msg = _error("Reshape", "reshape_param { shape { dim: 3 dim: 3 } }", [X4])
    assert "does not hold the 120 values" in msg
    msg = _error("Slice", "slice_param { slice_point: 3 slice_point: 2 }", [randn(2, 6)], n_top=3)
    assert "slice_param.slice_point: must be positive and strictly increasing, got [3, 2]" in msg
    msg = _error("Slice", "slice_param { slice_point: 8 }", [randn(2, 6)], n_top=2)
    assert "inside axis 1 of size 6" in msg
    msg = _error("Slice", "", [randn(2, 5)], n_top=2)
    assert "does not split evenly" in msg
    msg = _error("Eltwise", "eltwise_param { coeff: 1 }", [randn(2), randn(2)])
    assert "one value per bottom (2)" in msg
    msg = _error("Eltwise", "eltwise_param { operation: MAX coeff: 1 coeff: 1 }", [randn(2), randn(2)])
    assert "only SUM takes coefficients" in msg
    msg = _error("Eltwise", "", [randn(2, 3), randn(3, 2)])
    assert "2x3" in msg and "3x2" in msg
    msg = _error("InnerProduct", "inner_product_param { }", [randn(2, 3)])
    assert "num_output: must be positive" in msg
    msg = _error("Scale", "", [randn(2, 3, 4), randn(4, 3)])
    assert "bottom[1]: shape 4x3 does not match bottom[0] 2x3x4 from axis 1" in msg
    msg = _error("ArgMax", "argmax_param { top_k: 20 }", [randn(2, 3, 4)])
    assert "top_k: exceeds the 12 values" in msg
    msg = _error("Concat", "concat_param { axis: 1 concat_dim: 1 }", [randn(2, 3)])
    assert "either axis or concat_dim" in msg
    msg = _error("Softmax", "softmax_param { axis: 3 }", [randn(2, 3)])
    assert "softmax_param.axis: out of range" in msg


def test_inner_product_rejects_a_changed_input_size():
    layer, bottom, top = setup_layer("InnerProduct", "inner_product_param { num_output: 2 }", [randn(2, 3)])
    bottom[0].reshape(2, 4)
    with pytest.raises(ShapeError, match=r"\(InnerProduct\): bottom: input size from axis 1 must be 3"):
        layer.reshape(bottom, top)


def test_embed_rejects_out_of_range_indices():
    layer, bottom, top = setup_layer("Embed", "embed_param { num_output: 2 input_dim: 3 }",
                                     [np.array([0, 3], np.float32)])
    with pytest.raises(ShapeError, match=r"indices must be integers in \[0, 3\), got 3.0"):
        layer.forward(bottom, top)


def test_inner_product_matches_torch():
    torch = pytest.importorskip("torch")
    layer, bottom, top = setup_layer("InnerProduct", f"inner_product_param {{ num_output: 5 {GAUSS} }}",
                                     [randn(3, 2, 4)])
    layer.forward(bottom, top)
    lin = torch.nn.Linear(8, 5)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(layer.blobs[0].data))
        lin.bias.copy_(torch.from_numpy(layer.blobs[1].data))
        want = lin(torch.from_numpy(bottom[0].data.reshape(3, 8))).numpy()
    np.testing.assert_allclose(top[0].data, want, rtol=1e-5, atol=1e-6)


def test_scale_kernels_against_numpy():
    from caffepy.kernels import common as kernels
    from caffepy.kernels.reference import common as ref
    x, dy = randn(3, 7, 5003, seed=1), randn(3, 7, 5003, seed=2)
    s, b = randn(7, seed=3), randn(7, seed=4)
    y, saved = np.empty_like(x), np.empty_like(x)
    kernels.scale_forward(x, s, b, y, saved)
    np.testing.assert_allclose(y, ref.scale_forward(x, s, b), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(saved, x)
    kernels.scale_forward(x, s, None, y, None)
    np.testing.assert_allclose(y, ref.scale_forward(x, s), rtol=1e-6)
    dx, ds, db = np.empty_like(x), np.ones(7), np.ones(7)
    kernels.scale_backward(x, dy, s, dx, ds, db)
    want_dx, want_ds, want_db = ref.scale_backward(x, dy, s)
    np.testing.assert_allclose(ds, 1 + want_ds, rtol=1e-4)
    np.testing.assert_allclose(db, 1 + want_db, rtol=1e-4)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6)
    kernels.scale_backward(x, dy, s, dy, None, None)      # dx over dy, in place
    np.testing.assert_array_equal(dy, dx)


@pytest.mark.parametrize("type_,params", [("Flatten", ""), ("Reshape", "reshape_param { shape { dim: -1 } }")])
def test_views_refuse_in_place(type_, params):
    layer = make_layer(type_, params)
    b = _blob(X4)
    with pytest.raises(LayerError, match=rf"\({type_}\): top: cannot be computed in place.*got 't0'"):
        layer.layer_setup([b], [b])


@pytest.mark.parametrize("axis", [1, -1])
def test_softmax_matches_torch(axis):
    torch = pytest.importorskip("torch")
    x, dy = randn(3, 5, 4, seed=5, scale=4.0), randn(3, 5, 4, seed=6)
    layer, bottom, top = setup_layer("Softmax", f"softmax_param {{ axis: {axis} }}", [x])
    layer.forward(bottom, top)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    ty = torch.softmax(tx, axis)
    ty.backward(torch.from_numpy(dy.astype(np.float64)))
    np.testing.assert_allclose(top[0].data, ty.detach().numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(bottom[0].diff, tx.grad.numpy(), rtol=1e-4, atol=1e-6)


# -- BatchReindex / Filter / Parameter ----------------------------------------------------------
def test_batch_reindex_sums_the_diffs_of_a_repeated_item_and_checks_indices():
    layer, bottom, top = setup_layer("BatchReindex", "", [randn(3, 2), np.array([1, 1, 0], np.float32)])
    layer.forward(bottom, top)
    top[0].diff[...] = [[1, 2], [10, 20], [5, 5]]
    layer.backward(top, [True, False], bottom)
    np.testing.assert_array_equal(bottom[0].diff, [[5, 5], [11, 22], [0, 0]])
    bottom[1].data[...] = [0, 3, 1]
    with pytest.raises(ShapeError, match=r"bottom\[1\]: indices must lie in \[0, 3\).*got 3.0"):
        layer.forward(bottom, top)


def test_filter_keeps_the_batch_until_the_selector_is_known_then_zeroes_dropped_diffs():
    layer, bottom, top = setup_layer("Filter", "", [randn(4, 3), np.array([0, 1, 0, 1], np.float32)])
    assert top[0].shape == (4, 3)             # as Caffe: the setup-time shape keeps all items
    layer.reshape(bottom, top)
    assert top[0].shape == (2, 3)
    layer.forward(bottom, top)
    top[0].diff[...] = 1
    bottom[0].diff[...] = 7
    layer.backward(top, [True, False], bottom)
    np.testing.assert_array_equal(bottom[0].diff, [[0] * 3, [1] * 3, [0] * 3, [1] * 3])
    with pytest.raises(LayerError, match=r"top: needs one top per filtered bottom \(1\), got 2"):
        setup_layer("Filter", "", [randn(4, 3), np.ones(4, np.float32)], n_top=2)
    with pytest.raises(ShapeError, match=r"bottom\[1\]: the selector must be N or N x 1 x"):
        setup_layer("Filter", "", [randn(4, 3), np.ones((4, 2), np.float32)])


def test_parameter_top_is_the_blob_and_backward_accumulates():
    layer, bottom, top = setup_layer("Parameter", "parameter_param { shape { dim: 2 } }", [])
    assert layer.blobs[0].shape == (2,) and not layer.blobs[0].data.any()
    layer.forward(bottom, top)
    layer.blobs[0].data[...] = [3, 4]
    assert top[0].data.tolist() == [3, 4]
    layer.blobs[0].diff[...] = 1
    top[0].diff[...] = [2, 5]
    layer.backward(top, [], bottom)
    assert layer.blobs[0].diff.tolist() == [3, 6]


# -- Intel Caffe fields refused when a net is built ----------------------------------------------
@pytest.mark.parametrize("type_,params,bottoms,match", [
    ("InnerProduct", "inner_product_param { num_output: 2 relu: true negative_slope: -1 }", [randn(2, 3)],
     r"layer 'layer' \(InnerProduct\): inner_product_param.negative_slope: a fused ReLU takes a slope of at "
     r"least 0"),
    ("Reshape", "reshape_param { pixelshuffler: 2 }", [randn(1, 4, 2, 2)],
     r"reshape_param.pixelshuffler: the pixel shuffle \(Intel Caffe\) is not supported, got 2"),
    ("ReLU", "quantization_param { bw_layer_in: 8 is_negative_input: true }", [randn(2, 3)],
     r"layer 'layer' \(ReLU\): quantization_param: Intel Caffe's int8 inference quantizes Convolution "
     r"and InnerProduct only, got ReLU\. Remove quantization_param from this layer"),
])
def test_intel_fields_caffepy_does_not_run_are_refused(type_, params, bottoms, match):
    with pytest.raises(LayerError, match=match):
        setup_layer(type_, params, bottoms)
