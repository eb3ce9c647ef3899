"""caffepy.geometry: Caffe's output-size rules (against the NumPy references) and the windows
the plain and blocked layers read; tests/layers/test_intel.py checks both paths give one error."""
import numpy as np
import pytest

from caffepy import geometry
from caffepy.kernels.reference import vision as ref
from layer_cases import ref_unpack, randn, setup_layer


def test_pool_output_shape_matches_caffe_rounding():
    assert geometry.pool_output_shape(6, 6, 3, 3, 2, 2, 1, 1) == (4, 4)   # ceil((6+2-3)/2)+1
    assert geometry.pool_output_shape(5, 5, 2, 2, 2, 2, 1, 1) == (3, 3)   # last window dropped
    assert geometry.pool_output_shape(55, 55, 3, 3, 2, 2, 0, 0) == (27, 27)
    assert geometry.pool_output_shape(7, 7, 3, 3, 2, 2, 0, 0, False) == (3, 3)
    for H in range(1, 12):
        for k in range(1, 5):
            for s in range(1, 5):
                for p in range(0, k):
                    if H + 2 * p < k:
                        continue
                    for ceil_mode in (True, False):
                        assert geometry.pool_output_shape(H, H, k, k, s, s, p, p, ceil_mode)[0] \
                            == ref.pool_out_size(H, k, p, s, ceil_mode)


def test_conv_output_size_divides_as_c_does():
    # Caffe's int arithmetic truncates toward zero: a 3x3 kernel at stride 2 over a 2x2 input
    # has one window (its last row and column outside the image read as zero)
    assert geometry.conv_output_shape(2, 2, 3, 3, 0, 0, 2, 2) == (1, 1)
    assert geometry.conv_output_shape(2, 2, 3, 3, 0, 0, 1, 1) == (0, 0)
    for H in range(1, 12):
        for k in range(1, 5):
            for s in range(1, 4):
                for p in range(3):
                    for d in (1, 2):
                        if H + 2 * p >= d * (k - 1) + 1:
                            assert geometry.conv_output_size(H, k, p, s, d) == ref.conv_out_size(H, k, p, s, d)
    assert geometry.deconv_output_shape(4, 3, 3, 3, 1, 1, 2, 2) == (7, 5)


def test_pool_output_size_follows_caffe_when_the_kernel_exceeds_the_input():
    # ceil((6 - 7) / 2) + 1 = 1: Caffe pools the whole (clipped) input once
    assert geometry.pool_output_shape(6, 6, 7, 7, 2, 2, 0, 0) == (1, 1)
    assert geometry.pool_output_shape(6, 6, 7, 7, 2, 2, 0, 0, False) == (0, 0)


OVERHANG = [
    ("Convolution", "convolution_param { num_output: 3 kernel_size: 3 stride: 2 "
     "weight_filler { type: 'gaussian' std: 1 } bias_filler { type: 'gaussian' std: 1 } }", (2, 2)),
    ("Pooling", "pooling_param { pool: MAX kernel_size: 7 stride: 2 }", (6, 6)),
    ("Pooling", "pooling_param { pool: AVE kernel_h: 7 kernel_w: 6 stride: 2 }", (6, 5)),
]


@pytest.mark.parametrize("type_,params,hw", OVERHANG, ids=["conv", "max", "ave"])
def test_windows_past_the_input_agree_on_both_paths(type_, params, hw):
    x = randn(2, 3, *hw)
    plain, pb, pt = setup_layer(type_, params, [x])
    plain.forward(pb, pt)
    blocked, bb, bt = setup_layer(type_, params, [x], layout="blocked")
    blocked.blobs[:] = plain.blobs
    blocked.forward(bb, bt)
    assert pt[0].shape == (2, 3, 1, 1)
    np.testing.assert_allclose(ref_unpack(bt[0].data, 3), pt[0].data, rtol=1e-5, atol=1e-6)
    if type_ == "Convolution":
        w, b = (blob.data.astype(np.float64) for blob in plain.blobs)
        padded = np.zeros((2, 3, 3, 3))
        padded[:, :, :2, :2] = x
        want = np.einsum("nchw,ochw->no", padded, w) + b
    else:
        want = x.max(axis=(2, 3)) if "MAX" in params else x.mean(axis=(2, 3))
    np.testing.assert_allclose(pt[0].data.reshape(2, 3), want, rtol=1e-5, atol=1e-6)


def test_pool_pad_ratio_is_one_without_padding_or_with_include_pad():
    from caffepy.proto import caffe_pb2
    p = caffe_pb2.PoolingParameter(pool=caffe_pb2.PoolingParameter.AVE, avg_include_pad=False)
    window = geometry.Window((3, 3), (1, 1), (2, 2))
    ratio = geometry.pool_pad_ratio(p, window, 5, 5, 3, 3)
    # corner windows hold 4 of 9 padded slots, edges 6, the centre 9
    np.testing.assert_allclose(ratio, np.outer([1.5, 1, 1.5], [1.5, 1, 1.5]))
    assert geometry.pool_pad_ratio(p, window._replace(pad=(0, 0)), 5, 5, 2, 2) is None
    p.avg_include_pad = True
    assert geometry.pool_pad_ratio(p, window, 5, 5, 3, 3) is None
