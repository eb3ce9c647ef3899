"""Normalization layers: LRN, BatchNorm, MVN.

BatchNorm normalizes only; the learned scale and shift of a "batch norm" are a
Scale layer after it, as in Caffe. It also runs Intel Caffe's statistics groups
(bn_stats_batch_size / stats_batch_size) and fused ReLU.
"""
import numpy as np

from .. import memory
from ..errors import ShapeError
from ..kernels.reference import normalization as reference
from ..kernels.reference.normalization import MODE_BATCH_NORM, MODE_MEAN_ONLY, MODE_MVN
from ..layer import Layer, count_from, register
from ..proto import caffe_pb2

try:
    from ..kernels import normalization as _kernels
except ImportError:     # not built: the NumPy references are correct, only slower
    _kernels = None

LRNParameter = caffe_pb2.LRNParameter


@register
class LRN(Layer):
    """Local response normalization, y = x * scale^-beta, on N x C x H x W.
        ACROSS_CHANNELS: scale = k + alpha/size * sum of x^2 over `size` channels centred on c
        WITHIN_CHANNEL:  scale = 1 + alpha/size^2 * sum of x^2 over the size x size window
                         centred on (h, w) (Caffe's pooling composition: k is not used)
    Values past the edges count as zero. Reads lrn_param.local_size (odd), alpha, beta,
    k, norm_region. Not in place: the backward needs the input."""
    exact_bottoms = exact_tops = 1

    def setup(self, bottom, top):
        p = self.param.lrn_param
        self.size, self.alpha = int(p.local_size), float(p.alpha)
        self.beta, self.k = float(p.beta), float(p.k)
        self.region = p.norm_region
        if self.size < 1 or self.size % 2 == 0:
            raise self.error("lrn_param.local_size", "must be odd and positive", self.size)
        if self.region not in (LRNParameter.ACROSS_CHANNELS, LRNParameter.WITHIN_CHANNEL):
            raise self.error("lrn_param.norm_region", "unknown region", self.region)
        # the compiled kernels keep windows on the stack: 511 covers any real net
        self.compiled = _kernels is not None and self.size <= 511
        if top[0] is bottom[0]:
            raise self.error("top", "LRN cannot run in place (its backward needs the input)",
                             f"'{bottom[0].name}'")

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error("bottom[0]", "needs 4 axes (num, channels, height, width)",
                             bottom[0].shape, cls=ShapeError)
        top[0].reshape(bottom[0].shape)
        if getattr(self, "scale", None) is None or self.scale.shape != bottom[0].shape:
            self.scale = np.empty(bottom[0].shape, np.float32)

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        across = self.region == LRNParameter.ACROSS_CHANNELS
        if self.compiled:
            if across:
                _kernels.lrn_across_forward(x, y, self.scale, self.size, self.alpha, self.beta, self.k)
            else:
                _kernels.lrn_within_forward(x, y, self.scale, self.size, self.alpha, self.beta)
            return
        if across:
            out, scale = reference.lrn_across_forward(x, self.size, self.alpha, self.beta, self.k)
        else:
            out, scale = reference.lrn_within_forward(x, self.size, self.alpha, self.beta)
        y[...] = out
        self.scale[...] = scale

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x, dy, dx = bottom[0].data, top[0].diff, bottom[0].diff
        across = self.region == LRNParameter.ACROSS_CHANNELS
        if self.compiled:
            kernel = _kernels.lrn_across_backward if across else _kernels.lrn_within_backward
            kernel(x, self.scale, dy, dx, self.size, self.alpha, self.beta)
            return
        ref = reference.lrn_across_backward if across else reference.lrn_within_backward
        dx[...] = ref(x, top[0].data, self.scale, dy, self.size, self.alpha, self.beta)


def _channel_view(layer, blob):
    """(N, C, spatial) view of a blob as Caffe's BatchNorm sees it: axis 1 is the channel
    axis, a 1-axis blob is one channel."""
    shape = blob.shape
    if not shape:
        raise layer.error("bottom[0]", "needs at least one axis", shape, cls=ShapeError)
    channels = 1 if len(shape) == 1 else shape[1]
    return shape[0], channels, count_from(shape, 2)


@register
class BatchNorm(Layer):
    """Per-channel batch normalization, y = (x - mean) / sqrt(var + eps), then
    y = max(y, 0) with Intel's fused `relu` (its gradient passes where y > 0).
    TRAIN (use_global_stats false): mean and var (biased) over N and space, by statistics
    groups when a group size G is set (Intel Caffe): the batch is cut into N / G runs of G
    consecutive items, each normalized with its own mean and var. G comes from the net's
    `bn_stats_batch_size` when the NetParameter sets it (for every BatchNorm, over the
    layer's own field, as Intel's Net applies it), else from stats_batch_size; 0 is the whole
    batch, and G must divide N. The running statistics take one update per group, in batch
    order, as Caffe's is for the batch:
        blobs[2] = maf * blobs[2] + 1
        blobs[0] = mean + maf * blobs[0]
        blobs[1] = m/(m-1) * var + maf * blobs[1]     (m = values per channel of a group)
    use_global_stats (default in TEST): mean = blobs[0]/blobs[2], var = blobs[1]/blobs[2]
    (0 when blobs[2] is 0), groups unused. Backward, dy through the ReLU's gradient first:
        batch stats:  dx = (dy - mean(dy) - y mean(dy y)) / sqrt(var + eps)   (per group)
        global stats: dx = dy / sqrt(var + eps)
    The three blobs are statistics, not parameters: their lr_mult is forced to 0 (a
    param spec asking otherwise is an error, as in Caffe). Reads batch_norm_param
    use_global_stats, moving_average_fraction, eps, stats_batch_size, relu, and
    NetParameter.bn_stats_batch_size. Runs in place."""
    reshape_from_shapes = True
    exact_bottoms = exact_tops = 1

    def setup(self, bottom, top):
        p = self.param.batch_norm_param
        self.use_global_stats = p.use_global_stats if p.HasField("use_global_stats") \
            else self.phase == caffe_pb2.TEST
        self.maf = float(p.moving_average_fraction)
        self.eps = float(p.eps)
        self.relu = p.relu
        net = self.net_param
        if net is not None and net.HasField("bn_stats_batch_size"):
            self.group, self.group_field = net.bn_stats_batch_size, "NetParameter.bn_stats_batch_size"
        else:
            self.group, self.group_field = p.stats_batch_size, "batch_norm_param.stats_batch_size"
        _, channels, _ = _channel_view(self, bottom[0])
        zero = caffe_pb2.FillerParameter(type="constant", value=0.0)
        self.init_param_blobs([((channels,), zero), ((channels,), zero), ((1,), zero)])
        for i in range(3):
            if len(self.param.param) == i:
                self.param.param.add().lr_mult = 0.0
            elif self.param.param[i].lr_mult != 0:
                raise self.error(f"param[{i}].lr_mult", "batch normalization statistics cannot be "
                                 "learned; leave out the param specs or give lr_mult: 0",
                                 self.param.param[i].lr_mult)
        self.param_propagate_down = [False, False, False]

    def reshape(self, bottom, top):
        num, channels, spatial = _channel_view(self, bottom[0])
        if channels != self.blobs[0].count:
            raise self.error("bottom[0]", f"has {channels} channels, the statistics blobs "
                             f"{self.blobs[0].count}", bottom[0].shape, cls=ShapeError)
        self.dims = (num, channels, spatial)
        self.groups = 1
        if self.group and not self.use_global_stats:
            if num % self.group:
                raise self.error(self.group_field, f"must divide the batch size ({num}, bottom[0]'s "
                                 "first axis)", self.group,
                                 hint="Give a divisor of the batch, or 0 for whole-batch statistics")
            self.groups = num // self.group
        top[0].reshape(bottom[0].shape)

    def group_slices(self, per_item=1):
        """The statistics groups as slices of the first axis of an array with `per_item` rows
        for each item of the batch (1 for an N, C, S view; H * W for channels-last pixels)."""
        rows = self.dims[0] // self.groups * per_item if self.groups else 0
        return [slice(g * rows, (g + 1) * rows) for g in range(self.groups)]

    def update_statistics(self, mean, var, m):
        """One group's moving-average update (mean, biased var over m values per channel)."""
        correction = m / (m - 1) if m > 1 else 1.0
        self.blobs[2].data[...] = self.blobs[2].data * self.maf + 1.0
        self.blobs[0].data[...] = mean + self.maf * self.blobs[0].data
        self.blobs[1].data[...] = correction * var + self.maf * self.blobs[1].data

    def global_statistics(self):
        """mean (float32) and inv_std = 1 / sqrt(var + eps) from the stored statistics."""
        factor = float(self.blobs[2].data[0])
        factor = 0.0 if factor == 0 else 1.0 / factor
        mean = (self.blobs[0].data * np.float32(factor)).astype(np.float32)
        var = self.blobs[1].data.astype(np.float64) * np.float32(factor)
        return mean, (1.0 / np.sqrt(var + self.eps)).astype(np.float32)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.dims)
        y = top[0].data.reshape(self.dims)
        # a later in-place layer (Scale) may overwrite top: keep y (before the ReLU) for the
        # backward
        if self.use_global_stats:
            mean, self.inv_std = self.global_statistics()
            channel_affine(x, mean, self.inv_std, y)
            self.x_norm = None
            if self.relu:
                self.x_norm = kept_buffer(self, "_x_norm_buf", self.dims)
                np.copyto(self.x_norm, y)
                np.maximum(y, 0, out=y)
            return
        self.x_norm = kept_buffer(self, "_x_norm_buf", self.dims)
        self.inv_std = np.empty((self.groups, self.dims[1]), np.float32)
        m = self.dims[0] // max(self.groups, 1) * self.dims[2]
        for g, rows in enumerate(self.group_slices()):
            mean, var, self.inv_std[g] = normalize_forward(x[rows], y[rows], self.x_norm[rows],
                                                           MODE_BATCH_NORM, self.eps)
            self.update_statistics(mean, var, m)
        if self.relu:
            np.maximum(y, 0, out=y)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff.reshape(self.dims)
        dx = bottom[0].diff.reshape(self.dims)
        if self.relu:
            masked = kept_buffer(self, "_dy_buf", self.dims)
            np.multiply(dy, self.x_norm > 0, out=masked)
            dy = masked
        if self.use_global_stats:
            channel_affine(dy, np.zeros_like(self.inv_std), self.inv_std, dx)
            return
        for g, rows in enumerate(self.group_slices()):
            normalize_backward(dy[rows], self.x_norm[rows], self.inv_std[g], self.inv_std[g], dx[rows])


def kept_buffer(layer, attr, shape):
    """A float32 array of `shape` from a buffer the layer keeps between iterations in attribute
    `attr` (memory.grown)."""
    return memory.grown(vars(layer), attr, shape)


# -- per-channel passes over (N, C, S) views: kernels, or their NumPy references when not built
def normalize_forward(x, y, keep, mode, eps):
    """mean[c], biased var[c] of x[:, c, :] (float64), inv[c] (float32):
    1/sqrt(var + eps) (BatchNorm), 1/(sqrt(var) + eps) (MVN) or 1 (mean only);
    y = (x - mean) * inv, and keep = y when `keep` is given. y may be x."""
    C = x.shape[1]
    mean, var, inv = np.empty(C), np.empty(C), np.empty(C, np.float32)
    (_kernels or reference).normalize_forward(x, y, keep, mean, var, inv, mode, eps)
    return mean, var, inv


def normalize_backward(dy, y, inv, inv_y, dx):
    """dx = inv (dy - mean(dy)) - inv_y mean(dy y) y per channel; dx may be dy."""
    if _kernels is not None:
        _kernels.normalize_backward(dy, y, inv, np.asarray(inv_y, np.float32), dx)
    else:
        reference.normalize_backward(dy, y, inv, inv_y, dx)


def channel_affine(x, sub, mul, out):
    """out[:, c, :] = (x[:, c, :] - sub[c]) * mul[c]; out may be x."""
    sub, mul = np.asarray(sub, np.float32), np.asarray(mul, np.float32)
    (_kernels or reference).channel_affine(x, sub, mul, out)


@register
class MVN(Layer):
    """Mean-variance normalization of each item's channels (or of each whole item with
    across_channels): y = x - mean, and with normalize_variance y = (x - mean) / (std + eps),
    std the biased standard deviation (eps added after the root, as in Caffe).
    Backward: dx = (dy - mean(dy)) / (std + eps) - y mean(dy y) / std, or dy - mean(dy).
    That is the exact gradient; Caffe divides the last term by std + eps too, which
    differs only when eps is not small against std (default eps 1e-9).
    Reads mvn_param.normalize_variance, across_channels, eps. Runs in place."""
    exact_bottoms = exact_tops = 1

    def setup(self, bottom, top):
        p = self.param.mvn_param
        self.normalize_variance, self.across_channels = p.normalize_variance, p.across_channels
        self.eps = float(p.eps)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if not shape:
            raise self.error("bottom[0]", "needs at least one axis", shape, cls=ShapeError)
        rows = shape[0] if self.across_channels or len(shape) < 2 else shape[0] * shape[1]
        # one row per "channel" of the shared per-channel primitives
        self.dims = (1, rows, bottom[0].count // rows if rows else 0)
        top[0].reshape(shape)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.dims)
        y = top[0].data.reshape(self.dims)
        if not self.normalize_variance:
            normalize_forward(x, y, None, MODE_MEAN_ONLY, 0.0)
            return
        self.y = kept_buffer(self, "_y_buf", self.dims)
        _, var, self.inv = normalize_forward(x, y, self.y, MODE_MVN, self.eps)
        std = np.sqrt(var)
        # a constant row has y = 0: its y term in the backward vanishes instead of 0/0
        self.inv_std = np.divide(1.0, std, out=np.zeros_like(std), where=std > 0)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff.reshape(self.dims)
        dx = bottom[0].diff.reshape(self.dims)
        if self.normalize_variance:
            normalize_backward(dy, self.y, self.inv, self.inv_std, dx)
        else:
            ones = np.ones(self.dims[1], np.float32)
            normalize_backward(dy, dy, ones, np.zeros_like(ones), dx)
