"""caffepy.kernels.vision against the NumPy references in caffepy.kernels.reference.vision.

Diffs that the kernels accumulate start from random values; buffers they overwrite start as
NaN, so a kernel that reads what it should overwrite (or skips an element) fails.
"""
import numpy as np
import pytest

from caffepy import geometry
from caffepy.kernels import vision
from caffepy.kernels.reference import vision as ref

RNG = np.random.default_rng(1234)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def nans(*shape):
    return np.full(shape, np.nan, np.float32)


def close(got, want, rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.fixture(params=["images", "blas"])
def threading(request):
    before = vision.get_conv_threading()
    vision.set_conv_threading(request.param)
    yield request.param
    vision.set_conv_threading(before)


# --------------------------------------------------------------------------- im2col / col2im
# (C, H, W, kh, kw, pad, stride, dilation)
IM2COL_CASES = [
    (3, 7, 6, 3, 3, (1, 1), (1, 1), (1, 1)),
    (2, 9, 8, 3, 2, (2, 1), (2, 3), (1, 1)),     # asymmetric everything
    (2, 10, 9, 3, 3, (2, 2), (1, 1), (2, 3)),    # dilation
    (2, 11, 10, 2, 2, (0, 0), (3, 3), (1, 1)),   # stride > kernel: skipped pixels
    (4, 5, 5, 1, 1, (0, 0), (1, 1), (1, 1)),     # 1x1
    (1, 3, 3, 5, 5, (2, 2), (1, 1), (1, 1)),     # kernel as large as the padded image
    (3, 13, 1, 3, 1, (1, 0), (2, 1), (1, 1)),    # a single column
    (16, 24, 24, 3, 3, (1, 1), (1, 1), (1, 1)),  # large enough to split channels over threads
]


@pytest.mark.parametrize("case", IM2COL_CASES)
def test_im2col_col2im(case):
    C, H, W, kh, kw, pad, stride, dil = case
    oh, ow = geometry.conv_output_shape(H, W, kh, kw, *pad, *stride, *dil)
    assert (oh, ow) == (ref.conv_out_size(H, kh, pad[0], stride[0], dil[0]),
                        ref.conv_out_size(W, kw, pad[1], stride[1], dil[1]))
    im = rand(C, H, W)
    col = nans(C * kh * kw, oh * ow)
    vision.im2col(im, kh, kw, *pad, *stride, *dil, col)
    close(col, ref.im2col(im, kh, kw, pad, stride, dil), 0, 0)

    back = nans(C, H, W)
    col_in = rand(C * kh * kw, oh * ow)
    vision.col2im(col_in, kh, kw, *pad, *stride, *dil, back)
    close(back, ref.col2im(col_in, C, H, W, kh, kw, pad, stride, dil))

    batch = rand(3, C, H, W)
    cols = nans(3, C * kh * kw, oh * ow)
    vision.im2col_batch(batch, kh, kw, *pad, *stride, *dil, cols)
    for n in range(3):
        close(cols[n], ref.im2col(batch[n], kh, kw, pad, stride, dil), 0, 0)


def test_col2im_is_adjoint_of_im2col():
    C, H, W, kh, kw, pad, stride, dil = IM2COL_CASES[2]
    im = RNG.standard_normal((C, H, W))
    col = RNG.standard_normal(ref.im2col(im, kh, kw, pad, stride, dil).shape)
    lhs = np.vdot(ref.im2col(im, kh, kw, pad, stride, dil), col)
    assert np.isclose(lhs, np.vdot(im, ref.col2im(col, C, H, W, kh, kw, pad, stride, dil)))


# --------------------------------------------------------------------------- convolution
# (N, C, H, W, O, kh, kw, pad, stride, dilation, group)
CONV_CASES = [
    (3, 3, 9, 8, 4, 3, 3, (1, 1), (1, 1), (1, 1), 1),
    (2, 4, 11, 10, 6, 5, 3, (2, 1), (2, 3), (1, 1), 2),   # groups, odd strides
    (3, 2, 10, 9, 3, 3, 3, (2, 2), (1, 2), (2, 3), 1),    # dilation
    (2, 6, 7, 5, 4, 1, 1, (0, 0), (1, 1), (1, 1), 2),     # 1x1: no im2col, grouped
    (2, 3, 7, 7, 5, 1, 1, (1, 0), (2, 1), (1, 1), 1),     # 1x1 with pad/stride: im2col
    (1, 2, 6, 6, 2, 2, 2, (0, 0), (3, 3), (1, 1), 1),     # stride > kernel
    (5, 4, 5, 5, 4, 3, 3, (1, 1), (1, 1), (1, 1), 4),     # depthwise-like, more images
    # large enough for the threaded paths: images over threads (3 = a round of 2 + 1 left),
    # channels of im2col/col2im over threads
    (3, 8, 12, 12, 8, 3, 3, (1, 1), (1, 1), (1, 1), 2),
    (2, 16, 24, 24, 8, 3, 3, (1, 1), (1, 1), (1, 1), 1),
]


def _conv_buffers(case, full_workspace):
    N, C, H, W, O, kh, kw, pad, stride, dil, group = case
    oh, ow = geometry.conv_output_shape(H, W, kh, kw, *pad, *stride, *dil)
    wcount = O * (C // group) * kh * kw
    if full_workspace:
        ws = vision.conv_workspace_size(C, kh, kw, oh, ow, wcount)
    else:  # one column matrix: the kernel must fall back to fewer threads
        ws = C * kh * kw * oh * ow
    return oh, ow, np.zeros(max(ws, 1), np.float32)


@pytest.mark.parametrize("full_workspace", [True, False])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv(case, full_workspace, threading):
    N, C, H, W, O, kh, kw, pad, stride, dil, group = case
    oh, ow, col = _conv_buffers(case, full_workspace)
    bottom, weight, bias = rand(N, C, H, W), rand(O, C // group, kh, kw), rand(O)
    conv_args = (*pad, *stride, *dil, group)

    top = nans(N, O, oh, ow)
    vision.conv_forward(bottom, weight, bias, top, col, *conv_args)
    close(top, ref.conv_forward(bottom, weight, bias, pad, stride, dil, group))
    vision.conv_forward(bottom, weight, None, top, col, *conv_args)
    close(top, ref.conv_forward(bottom, weight, None, pad, stride, dil, group))

    top_diff = rand(N, O, oh, ow)
    want_w, want_b, want_x = ref.conv_backward(top_diff, bottom, weight, pad, stride, dil, group)
    weight_diff, bias_diff = rand(*weight.shape), rand(O)
    w0, b0 = weight_diff.copy(), bias_diff.copy()
    bottom_diff = nans(*bottom.shape)
    vision.conv_backward(top_diff, bottom, weight, weight_diff, bias_diff, bottom_diff, col,
                         *conv_args)
    close(weight_diff, w0 + want_w, atol=1e-4)
    close(bias_diff, b0 + want_b, atol=1e-4)
    close(bottom_diff, want_x)

    # each diff can be skipped alone
    only_x = nans(*bottom.shape)
    vision.conv_backward(top_diff, bottom, weight, None, None, only_x, col, *conv_args)
    close(only_x, want_x)
    only_w = np.zeros_like(weight)
    vision.conv_backward(top_diff, bottom, weight, only_w, None, None, col, *conv_args)
    close(only_w, want_w, atol=1e-4)


def test_conv_reference_gradients_are_adjoint():
    # the conv backward reference is hand-derived: check it against the forward by linearity
    N, C, H, W, O, kh, kw, pad, stride, dil, group = CONV_CASES[1]
    x = RNG.standard_normal((N, C, H, W))
    w = RNG.standard_normal((O, C // group, kh, kw))
    y = ref.conv_forward(x, w, None, pad, stride, dil, group)
    dy = RNG.standard_normal(y.shape)
    dw, db, dx = ref.conv_backward(dy, x, w, pad, stride, dil, group)
    assert np.isclose(np.vdot(y, dy), np.vdot(x, dx))
    assert np.isclose(np.vdot(y, dy), np.vdot(w, dw))
    assert np.isclose(dy.sum(), np.vdot(np.ones_like(db), db))


# (N, Ci, H, W, Co, kh, kw, pad, stride, dilation, group): bottom is [N, Ci, H, W]
DECONV_CASES = [
    (2, 4, 5, 4, 3, 4, 4, (1, 1), (2, 2), (1, 1), 1),
    (3, 4, 4, 5, 6, 3, 2, (0, 1), (1, 2), (2, 1), 2),
    (2, 6, 4, 4, 4, 1, 1, (0, 0), (1, 1), (1, 1), 2),     # 1x1
]


@pytest.mark.parametrize("case", DECONV_CASES)
def test_deconv(case, threading):
    N, Ci, H, W, Co, kh, kw, pad, stride, dil, group = case
    Ho, Wo = geometry.deconv_output_shape(H, W, kh, kw, *pad, *stride, *dil)
    assert geometry.conv_output_shape(Ho, Wo, kh, kw, *pad, *stride, *dil) == (H, W)
    wcount = Ci * (Co // group) * kh * kw
    col = np.zeros(max(vision.conv_workspace_size(Co, kh, kw, H, W, wcount), 1), np.float32)
    bottom, weight, bias = rand(N, Ci, H, W), rand(Ci, Co // group, kh, kw), rand(Co)
    conv_args = (*pad, *stride, *dil, group)

    top = nans(N, Co, Ho, Wo)
    vision.deconv_forward(bottom, weight, bias, top, col, *conv_args)
    close(top, ref.deconv_forward(bottom, weight, bias, (Ho, Wo), pad, stride, dil, group))

    top_diff = rand(N, Co, Ho, Wo)
    want_w, want_b, want_x = ref.deconv_backward(top_diff, bottom, weight, pad, stride, dil,
                                                 group)
    weight_diff, bias_diff = rand(*weight.shape), rand(Co)
    w0, b0 = weight_diff.copy(), bias_diff.copy()
    bottom_diff = nans(*bottom.shape)
    vision.deconv_backward(top_diff, bottom, weight, weight_diff, bias_diff, bottom_diff, col,
                           *conv_args)
    close(weight_diff, w0 + want_w, atol=1e-4)
    close(bias_diff, b0 + want_b, atol=1e-4)
    close(bottom_diff, want_x)


def test_conv_threading_is_one_of_two_modes():
    with pytest.raises(ValueError, match="images"):
        vision.set_conv_threading("both")
    assert vision.get_conv_threading() in ("images", "blas")


def test_conv_rejects_buffers_that_do_not_fit():
    bottom, weight = rand(1, 4, 6, 6), rand(2, 4, 3, 3)
    top = nans(1, 2, 4, 4)
    with pytest.raises(ValueError, match="col_buffer"):
        vision.conv_forward(bottom, weight, None, top, np.zeros(10, np.float32),
                            0, 0, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="top"):
        vision.conv_forward(bottom, weight, None, nans(1, 2, 5, 4), np.zeros(999, np.float32),
                            0, 0, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="group"):
        vision.conv_forward(bottom, rand(2, 2, 3, 3), None, top, np.zeros(999, np.float32),
                            0, 0, 1, 1, 1, 1, 3)


# --------------------------------------------------------------------------- pooling
# (N, C, H, W, kh, kw, sh, sw, ph, pw)
POOL_CASES = [
    (2, 3, 7, 7, 3, 3, 2, 2, 0, 0),     # ceil: last window over the edge
    (2, 2, 6, 6, 3, 3, 2, 2, 1, 1),     # pad + ceil
    (1, 3, 5, 5, 2, 2, 2, 2, 1, 1),     # pad: the window past H + pad is dropped
    (2, 2, 11, 9, 2, 3, 3, 4, 0, 1),    # stride > kernel, asymmetric
    (3, 2, 5, 7, 5, 7, 1, 1, 0, 0),     # global pooling
    (1, 2, 9, 8, 4, 3, 3, 2, 2, 1),     # odd everything
    (1, 1, 1, 1, 1, 1, 1, 1, 0, 0),
    (2, 16, 32, 32, 3, 3, 2, 2, 1, 1),  # large enough to split planes over threads
]


@pytest.mark.parametrize("case", POOL_CASES)
def test_max_pool(case):
    N, C, H, W, kh, kw, sh, sw, ph, pw = case
    oh, ow = geometry.pool_output_shape(H, W, kh, kw, sh, sw, ph, pw)
    bottom = rand(N, C, H, W)
    top, mask = nans(N, C, oh, ow), np.full((N, C, oh, ow), -7, np.int32)
    vision.max_pool_forward(bottom, top, mask, kh, kw, sh, sw, ph, pw)
    want_top, want_mask = ref.max_pool_forward(bottom, kh, kw, sh, sw, ph, pw, oh, ow)
    close(top, want_top, 0, 0)
    np.testing.assert_array_equal(mask, want_mask)

    top_diff = rand(N, C, oh, ow)
    bottom_diff = nans(N, C, H, W)
    vision.max_pool_backward(top_diff, mask, bottom_diff)
    close(bottom_diff, ref.max_pool_backward(top_diff, want_mask, H, W))


def test_max_pool_ties_pick_the_first_in_the_window():
    # all ones: each clipped window reports its top-left pixel (rows start 0, 1; cols 0, 1)
    bottom = np.ones((1, 1, 4, 4), np.float32)
    top, mask = nans(1, 1, 2, 2), np.zeros((1, 1, 2, 2), np.int32)
    vision.max_pool_forward(bottom, top, mask, 3, 3, 2, 2, 1, 1)
    np.testing.assert_array_equal(mask[0, 0], [[0, 1], [4, 5]])
    bottom_diff = nans(1, 1, 4, 4)
    vision.max_pool_backward(np.full((1, 1, 2, 2), 2.0, np.float32), mask, bottom_diff)
    assert bottom_diff.sum() == 8.0 and bottom_diff[0, 0, 1, 1] == 2.0


@pytest.mark.parametrize("case", POOL_CASES)
def test_ave_pool(case):
    N, C, H, W, kh, kw, sh, sw, ph, pw = case
    oh, ow = geometry.pool_output_shape(H, W, kh, kw, sh, sw, ph, pw)
    bottom = rand(N, C, H, W)
    top = nans(N, C, oh, ow)
    vision.ave_pool_forward(bottom, top, kh, kw, sh, sw, ph, pw)
    close(top, ref.ave_pool_forward(bottom, kh, kw, sh, sw, ph, pw, oh, ow))

    top_diff = rand(N, C, oh, ow)
    bottom_diff = nans(N, C, H, W)
    vision.ave_pool_backward(top_diff, bottom_diff, kh, kw, sh, sw, ph, pw)
    close(bottom_diff, ref.ave_pool_backward(top_diff, H, W, kh, kw, sh, sw, ph, pw))


def test_ave_pool_divides_by_the_padded_window():
    # 3x3 window, pad 1 on a 2x2 image of ones: the corner window holds 4 pixels of 9 slots
    top = nans(1, 1, 1, 1)
    vision.ave_pool_forward(np.ones((1, 1, 2, 2), np.float32), top, 3, 3, 2, 2, 1, 1)
    assert top[0, 0, 0, 0] == pytest.approx(4 / 9)


def test_pool_rejects_windows_past_the_image():
    with pytest.raises(ValueError, match="pool_output_shape"):
        vision.ave_pool_forward(rand(1, 1, 5, 5), nans(1, 1, 4, 4), 2, 2, 2, 2, 1, 1)
    with pytest.raises(ValueError, match="pad"):
        vision.ave_pool_forward(rand(1, 1, 5, 5), nans(1, 1, 3, 3), 2, 2, 2, 2, 2, 2)


def test_roi_pool_matches_the_reference_ties_and_empty_bins():
    gen = np.random.default_rng(5)
    x = np.round(gen.standard_normal((2, 3, 7, 9)), 1).astype(np.float32)     # rounded: ties
    batch = np.array([0, 1, 1], np.int32)
    hs = np.array([[0, 2], [3, 3], [6, 7]], np.int32)
    he = np.array([[2, 5], [7, 3], [7, 7]], np.int32)        # (1, 1) and (2, 1) are empty
    ws = np.array([[0, 4, 8], [1, 1, 2], [0, 3, 6]], np.int32)
    we = np.array([[4, 8, 9], [2, 3, 9], [3, 6, 9]], np.int32)
    top = np.empty((3, 3, 2, 3), np.float32)
    argmax = np.empty((3, 3, 2, 3), np.int32)
    vision.roi_pool_forward(x, batch, hs, he, ws, we, top, argmax)
    want_top, want_arg = ref.roi_pool_forward(x, batch, hs, he, ws, we)
    np.testing.assert_array_equal(argmax, want_arg)
    np.testing.assert_array_equal(top, want_top.astype(np.float32))
    assert (argmax[1, :, 1] == -1).all() and (top[1, :, 1] == 0).all()
    with pytest.raises(ValueError, match=r"roi_pool_forward: batch: must lie in \[0, 2\), got 2"):
        vision.roi_pool_forward(x, np.array([0, 2, 1], np.int32), hs, he, ws, we, top, argmax)
    with pytest.raises(ValueError, match=r"roi_pool_forward: hstart/hend: must lie in \[0, 7\]"):
        vision.roi_pool_forward(x, batch, hs, he + 1, ws, we, top, argmax)
