"""caffepy.kernels.nhwc.conv_forward's epilogue (a TEST net's BatchNorm, Scale, Eltwise SUM and
ReLU after a convolution, caffepy/net_rules.py): y = conv(x, W) * scale + bias + add, then
max(y, 0), against the
NumPy reference convolution, for the pointwise GEMM over the batch (Caffe's weight order) and
im2col's (the weights reordered, several row chunks an image), with one thread's scratch or
two's, on the weights as they are and packed once (pack_weights: a TEST net's)."""
import numpy as np
import pytest

from caffepy.kernels import nhwc
from caffepy.kernels.reference import vision as ref


@pytest.mark.parametrize("k, pad, rows, threads", [(1, 0, 0, 1), (1, 0, 16, 2), (3, 1, 16, 1),
                                                   (3, 1, 16, 2)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_epilogue_against_the_reference(k, pad, rows, threads, relu, with_scale, with_add,
                                        packed):
    rng = np.random.default_rng(7)
    n, c, h, w, o = 2, 5, 6, 7, 6
    x = rng.standard_normal((n, c, h, w), dtype=np.float32)
    weights = rng.standard_normal((o, c, k, k), dtype=np.float32)
    scale = rng.standard_normal(o, dtype=np.float32) if with_scale else None
    bias = rng.standard_normal(o, dtype=np.float32)
    want = ref.conv_forward(x, weights, None, pad=(pad, pad)).astype(np.float64)
    if scale is not None:
        want *= scale[None, :, None, None]
    want += bias[None, :, None, None]
    add = rng.standard_normal((n, h, w, o), dtype=np.float32) if with_add else None
    if add is not None:
        want += add.transpose(0, 3, 1, 2)
    if relu:
        want = np.maximum(want, 0)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    caffe_order = k == 1
    if caffe_order:
        wt = weights.reshape(1, o, c)
        rows = rows or n * h * w            # the whole batch's pixels at once, or in tasks
        col = np.zeros((threads, 0), np.float32)
    else:
        wt = np.ascontiguousarray(weights.transpose(2, 3, 1, 0).reshape(1, k * k * c, o))
        col = np.zeros((threads, nhwc.conv_col_floats(c, k, k, h, w, rows)), np.float32)
    y = np.full((n, h, w, o), np.nan, np.float32)
    panels = _packed(wt, caffe_order) if packed else None
    nhwc.conv_forward(xl, wt, bias, y, col, o, k, k, pad, pad, 1, 1, 1, 1, 1, rows, caffe_order,
                      scale, relu, add, panels)
    np.testing.assert_allclose(y.transpose(0, 3, 1, 2), want, rtol=1e-5, atol=1e-5)
    if relu:
        assert (y == 0).any() and (y >= 0).all()


def _packed(wt, caffe_order):
    g, og, kg = (wt.shape[0], wt.shape[1], wt.shape[2]) if caffe_order else \
        (wt.shape[0], wt.shape[2], wt.shape[1])
    out = np.full(nhwc.packed_floats(g, og, kg), np.nan, np.float32)
    nhwc.pack_weights(wt, caffe_order, out)
    return out


@pytest.mark.parametrize("k, stride, group", [(1, 1, 1), (1, 1, 2), (3, 1, 2), (3, 2, 1)])
@pytest.mark.parametrize("n", [1, 3])
def test_packed_weights_of_many_channels_against_the_reference(k, stride, group, n):
    """Enough output channels for several panels a group and an epilogue on each thread's block
    (the threads split the channels at batch 1, the rows or the tasks at batch 3)."""
    rng = np.random.default_rng(3)
    c, h, o = 64, 9, 200
    x = rng.standard_normal((n, c, h, h), dtype=np.float32)
    weights = rng.standard_normal((o, c // group, k, k), dtype=np.float32)
    scale = rng.standard_normal(o, dtype=np.float32)
    bias = rng.standard_normal(o, dtype=np.float32)
    want = ref.conv_forward(x, weights, None, stride=(stride, stride), group=group)
    want = np.maximum(want * scale[None, :, None, None] + bias[None, :, None, None], 0)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    caffe_order = k == 1 and stride == 1
    kg = c // group * k * k
    w = weights.reshape(group, o // group, c // group, k * k)
    wt = w.reshape(group, o // group, kg) if caffe_order else \
        np.ascontiguousarray(w.transpose(0, 3, 2, 1).reshape(group, kg, o // group))
    oh = (h - k) // stride + 1
    rows = 1000
    col = np.zeros((2, nhwc.conv_col_floats(c, k, k, oh, oh, rows)), np.float32)
    y = np.full((n, oh, oh, o), np.nan, np.float32)
    nhwc.conv_forward(xl, wt, bias, y, col, o, k, k, 0, 0, stride, stride, 1, 1, group, rows,
                      caffe_order, scale, True, None, _packed(wt, caffe_order))
    np.testing.assert_allclose(y.transpose(0, 3, 1, 2), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("c", [48, 600])
def test_packed_epilogue_on_whole_vectors(n, relu, with_add, c):
    """The epilogue on packed weights over whole vectors and a panel's partial width, with or
    without a summand, the threads splitting the channels (batch 1) or the rows (batch 3); with
    600 input channels, more than one pass of the panels takes (512 steps, 128 for few rows):
    applied as the last pass stores each tile, the epilogue sees the whole sum."""
    rng = np.random.default_rng(4)
    h, o = 9, 3 * 64 + 21
    x = rng.standard_normal((n, c, h, h), dtype=np.float32)
    weights = rng.standard_normal((o, c, 1, 1), dtype=np.float32) / np.float32(np.sqrt(c / 48))
    scale = rng.standard_normal(o, dtype=np.float32)
    bias = rng.standard_normal(o, dtype=np.float32)
    add = rng.standard_normal((n, h, h, o), dtype=np.float32) if with_add else None
    want = ref.conv_forward(x, weights, None).astype(np.float64)
    want = want * scale[None, :, None, None] + bias[None, :, None, None]
    if with_add:
        want += add.transpose(0, 3, 1, 2)
    if relu:
        want = np.maximum(want, 0)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    wt = weights.reshape(1, o, c)
    y = np.full((n, h, h, o), np.nan, np.float32)
    nhwc.conv_forward(xl, wt, bias, y, np.zeros((2, 0), np.float32), o, 1, 1, 0, 0, 1, 1, 1, 1,
                      1, n * h * h, True, scale, relu, add, _packed(wt, True))
    np.testing.assert_allclose(y.transpose(0, 3, 1, 2), want, rtol=1e-4, atol=1e-4)


def test_packed_weights_of_another_shape_are_refused():
    x = np.zeros((1, 2, 2, 3), np.float32)
    wt = np.zeros((1, 4, 3), np.float32)
    with pytest.raises(ValueError, match="conv_forward: packed: needs"):
        nhwc.conv_forward(x, wt, np.zeros(0, np.float32), np.zeros((1, 2, 2, 4), np.float32),
                          np.zeros((1, 0), np.float32), 4, 1, 1, 0, 0, 1, 1, 1, 1, 1, 4, True,
                          None, False, None, np.zeros(3, np.float32))


def test_a_scale_of_the_wrong_length_is_refused():
    x = np.zeros((1, 2, 2, 3), np.float32)
    with pytest.raises(ValueError, match="conv_forward: scale: needs 4 values"):
        nhwc.conv_forward(x, np.zeros((1, 4, 3), np.float32), np.zeros(0, np.float32),
                          np.zeros((1, 2, 2, 4), np.float32), np.zeros((1, 0), np.float32),
                          4, 1, 1, 0, 0, 1, 1, 1, 1, 1, 4, True, np.zeros(3, np.float32))


def test_an_add_of_the_wrong_shape_or_in_place_is_refused():
    x, y = np.zeros((1, 2, 2, 3), np.float32), np.zeros((1, 2, 2, 4), np.float32)
    args = (np.zeros((1, 4, 3), np.float32), np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="conv_forward: add: "):
        nhwc.conv_forward(x, *args, y, np.zeros((1, 0), np.float32), 4, 1, 1, 0, 0, 1, 1, 1, 1, 1,
                          4, True, None, False, np.zeros((1, 2, 2, 3), np.float32))
    with pytest.raises(ValueError, match="conv_forward: add: may be y only on packed weights"
                                         ".*got y, unpacked"):
        nhwc.conv_forward(x, *args, y, np.zeros((1, 0), np.float32), 4, 1, 1, 0, 0, 1, 1, 1, 1, 1,
                          4, True, None, False, y)


@pytest.mark.parametrize("k, n, o, c", [(1, 1, 3 * 64 + 21, 48), (1, 3, 3 * 64 + 21, 48),
                                        (1, 3, 40, 48), (3, 2, 70, 12), (1, 3, 40, 300),
                                        (1, 1, 3 * 64 + 21, 600)])
@pytest.mark.parametrize("relu", [False, True])
def test_the_sum_written_over_its_add_is_the_sum_written_apart(k, n, o, c, relu):
    """add as y itself (a block end's sum over its shortcut, caffepy/net_memory.py): each value
    read where its sum goes, the same floats as into another array, whether the threads split
    the channels (batch 1) or the rows, over whole vectors and a panel's partial width, a 1 x 1
    product or im2col's; and where the sums take several passes over K (600 products over few
    rows, and 300 at 16 lanes: add_may_be_y says no), from the add kept aside."""
    rng = np.random.default_rng(5)
    h = 9 if k == 1 else 6
    x = rng.standard_normal((n, h, h, c), dtype=np.float32)
    weights = rng.standard_normal((o, c, k, k), dtype=np.float32) / np.float32(np.sqrt(c / 48))
    if k == 1:
        wt = weights.reshape(1, o, c)
        col = np.zeros((2, 0), np.float32)
    else:
        wt = np.ascontiguousarray(weights.transpose(2, 3, 1, 0).reshape(1, k * k * c, o))
        col = np.zeros((2, nhwc.conv_col_floats(c, k, k, h, h, 20)), np.float32)
    scale = rng.standard_normal(o, dtype=np.float32)
    bias = rng.standard_normal(o, dtype=np.float32)
    add = rng.standard_normal((n, h, h, o), dtype=np.float32)
    panels = _packed(wt, k == 1)
    args = (o, k, k, k // 2, k // 2, 1, 1, 1, 1, 1, n * h * h if k == 1 else 20, k == 1, scale,
            relu)
    apart = np.full_like(add, np.nan)
    nhwc.conv_forward(x, wt, bias, apart, col, *args, add, panels)
    over = add.copy()
    nhwc.conv_forward(x, wt, bias, over, col, *args, over, panels)
    np.testing.assert_array_equal(over, apart)
    assert not np.array_equal(over, add)
    assert nhwc.add_may_be_y(c * k * k, n * h * h if k == 1 else 0, n * h * h, o, 2) == (
        c <= nhwc.ONE_PASS_K)


def test_add_may_be_y_by_the_products_rows():
    """One pass over K: up to PG_ONE_PASS_K products always; up to 512 when no product part
    of a 1 x 1 convolution has 768 rows or fewer (16 lanes; 8 lanes pass 512 at any rows)."""
    any_rows = nhwc.add_may_be_y(256)                        # 8 lanes: yes, 16: no
    assert nhwc.add_may_be_y(128) and not nhwc.add_may_be_y(1024, 3136, 784, 1024, 2)
    assert nhwc.add_may_be_y(256, 3136, 784, 1024, 2)        # ResNet-50 b16's res4 block end
    assert nhwc.add_may_be_y(256, 196, 196, 1024, 2) == any_rows        # b1's: 196 rows
    # 784 rows split in two by the threads (fewer rows than channels would split channels)
    assert nhwc.add_may_be_y(256, 3136, 784, 256, 2) == any_rows
    assert nhwc.add_may_be_y(256, 3136, 784, 256, 1)


def test_epilogue_loads_no_masked_vectors():
    """The epilogue's tests on NULL pointers must stay outside its loops: if-converted, they
    become masked loads (vmaskmovps) from NULL + offset, and on AMD Zen each such load from an
    unmapped page costs a microcode assist (a fifth of ResNet-50's forward). An inline helper
    for the two loops brought 16 of them back."""
    import re
    import shutil
    import subprocess
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", nhwc.__file__],
                          capture_output=True, text=True, check=True).stdout
    bodies = re.findall(r"^[0-9a-f]+ <(\w*_fwd_rows\w*)>:\n(.*?)(?:\n\n|\Z)", text, re.M | re.S)
    assert bodies, "no _fwd_rows in the disassembly"
    for name, body in bodies:
        assert not re.search(r"\bv(p)?maskmov", body), f"{name} has masked vector loads"


@pytest.mark.parametrize("k, pad, rows, threads", [(1, 0, 0, 1), (1, 0, 16, 2), (3, 1, 16, 1),
                                                   (3, 1, 100, 2)])
@pytest.mark.parametrize("packed", [False, True])
def test_a_forward_into_a_run_of_a_wider_blobs_channels(k, pad, rows, threads, packed):
    """y a slice of a wider channels-last array's last axis (a concat's top written in place):
    the same bits in its channels as into an array of its own, and the other channels as they
    were; an output whose pixels are not equally spaced is refused in one line."""
    rng = np.random.default_rng(11)
    n, c, h, w, o, lo, wide = 2, 5, 6, 7, 6, 3, 17
    xl = rng.standard_normal((n, h, w, c), dtype=np.float32)
    weights = rng.standard_normal((o, c, k, k), dtype=np.float32)
    bias = rng.standard_normal(o, dtype=np.float32)
    scale = rng.standard_normal(o, dtype=np.float32)
    caffe_order = k == 1
    if caffe_order:
        wt = weights.reshape(1, o, c)
        rows = rows or n * h * w
        col = np.zeros((threads, 0), np.float32)
    else:
        wt = np.ascontiguousarray(weights.transpose(2, 3, 1, 0).reshape(1, k * k * c, o))
        col = np.zeros((threads, nhwc.conv_col_floats(c, k, k, h, w, rows)), np.float32)
    panels = _packed(wt, caffe_order) if packed else None
    args = (o, k, k, pad, pad, 1, 1, 1, 1, 1, rows, caffe_order, scale, True, None, panels)
    own = np.empty((n, h, w, o), np.float32)
    nhwc.conv_forward(xl, wt, bias, own, col, *args)
    full = np.full((n, h, w, wide), 7.5, np.float32)
    nhwc.conv_forward(xl, wt, bias, full[..., lo:lo + o], col, *args)
    np.testing.assert_array_equal(full[..., lo:lo + o].view(np.int32), own.view(np.int32))
    assert (full[..., :lo] == 7.5).all() and (full[..., lo + o:] == 7.5).all()
    with pytest.raises(ValueError, match="conv_forward: y: needs its pixels equally spaced"):
        nhwc.conv_forward(xl, wt, bias, np.zeros((n, w, h, o), np.float32).transpose(0, 2, 1, 3),
                          col, *args)


@pytest.mark.parametrize("k, stride, o", [(3, 2, 21), (1, 1, 8), (5, 1, 3)])
def test_a_direct_forward_into_a_run_of_a_wider_blobs_channels(k, stride, o):
    """The direct kernel writing outputs ps floats a pixel apart (its y [N, floats an image]
    a view of a wider channels-last array from channel lo): the same bits as into its own
    array, the other channels untouched (whole and part vectors of outputs)."""
    rng = np.random.default_rng(13)
    n, c, h, w, lo, wide = 2, 3, 9, 7, 2, o + 9
    xl = rng.standard_normal((n, h, w, c), dtype=np.float32)
    weights = rng.standard_normal((o, c, k, k), dtype=np.float32)
    v, _ = nhwc.direct_widths()
    op = -(-o // v) * v
    wp = np.zeros((k * k * c, op), np.float32)
    wp[:, :o] = weights.transpose(2, 3, 1, 0).reshape(-1, o)
    bp = np.zeros(op, np.float32)
    bp[:o] = rng.standard_normal(o, dtype=np.float32)
    pad = k // 2
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    xpad = np.zeros((2, nhwc.conv_direct_plane(h, w, c, k, k, pad, pad, stride, stride, 1, 1)),
                    np.float32)
    geometry = (k, k, pad, pad, stride, stride, 1, 1)
    own = np.empty((n, oh, ow, o), np.float32)
    nhwc.conv_direct_forward(xl, c, wp, bp, own.reshape(n, -1), o, o, o, 0, xpad, *geometry,
                             relu=True)
    full = np.full((n, oh, ow, wide), 9.5, np.float32)
    y = np.lib.stride_tricks.as_strided(full[..., lo:], (n, (oh * ow - 1) * wide + o),
                                        (full.strides[0], 4))
    nhwc.conv_direct_forward(xl, c, wp, bp, y, o, wide, o, 0, xpad, *geometry, relu=True)
    np.testing.assert_array_equal(full[..., lo:lo + o].view(np.int32), own.view(np.int32))
    assert (full[..., :lo] == 9.5).all() and (full[..., lo + o:] == 9.5).all()
