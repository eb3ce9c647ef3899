"""Vision layers against naive NumPy loops written for these tests."""
import numpy as np
import pytest

from layer_cases import TEST, Case, case_tests, distinct, pool_expected, randn, setup_layer

FILL = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.3 }'


def naive_conv(x, w, b, pad, stride, dil, group):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh = (h + 2 * pad[0] - (dil[0] * (kh - 1) + 1)) // stride[0] + 1
    ow = (wd + 2 * pad[1] - (dil[1] * (kw - 1) + 1)) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    og = o // group
    for oc in range(o):
        g = oc // og
        for y in range(oh):
            for xx in range(ow):
                patch = xp[:, g * cg:(g + 1) * cg,
                           y * stride[0]: y * stride[0] + dil[0] * (kh - 1) + 1: dil[0],
                           xx * stride[1]: xx * stride[1] + dil[1] * (kw - 1) + 1: dil[1]]
                out[:, oc, y, xx] = np.tensordot(patch, w[oc], axes=([1, 2, 3], [0, 1, 2]))
        if b is not None:
            out[:, oc] += b[oc]
    return out


def conv_expected(pad=(0, 0), stride=(1, 1), dil=(1, 1), group=1, bias=True):
    def expected(x, layer):
        w = layer.blobs[0].data.astype(np.float64)
        b = layer.blobs[1].data.astype(np.float64) if bias else None
        return [naive_conv(x, w, b, pad, stride, dil, group)]
    return expected


def deconv_expected(pad, stride, group=1):
    # deconvolution = the input-gradient of the convolution with the same weights
    def expected(x, layer):
        w = layer.blobs[0].data.astype(np.float64)          # [Ci, Co/g, kh, kw]
        n, ci, h, wd = x.shape
        _, cog, kh, kw = w.shape
        oh = stride[0] * (h - 1) + kh - 2 * pad[0]
        ow = stride[1] * (wd - 1) + kw - 2 * pad[1]
        out = np.zeros((n, cog * group, oh + 2 * pad[0], ow + 2 * pad[1]))
        cig = ci // group
        for c in range(ci):
            g = c // cig
            for y in range(h):
                for xx in range(wd):
                    out[:, g * cog:(g + 1) * cog, y * stride[0]:y * stride[0] + kh,
                        xx * stride[1]:xx * stride[1] + kw] += x[:, c, y, xx][:, None, None, None] * w[c][None]
        out = out[:, :, pad[0]:pad[0] + oh, pad[1]:pad[1] + ow]
        return [out + layer.blobs[1].data.astype(np.float64)[None, :, None, None]]
    return expected


CASES = [
    Case("Convolution", f"convolution_param {{ num_output: 4 kernel_size: 3 {FILL} }}",
         [randn(2, 3, 6, 5)], expected=conv_expected(), id="conv-3x3"),
    Case("Convolution", f"convolution_param {{ num_output: 4 kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 0"
         f" stride_h: 2 stride_w: 1 {FILL} }}", [randn(2, 3, 7, 6)],
         expected=conv_expected(pad=(1, 0), stride=(2, 1)), id="conv-rect-pad-stride"),
    Case("Convolution", f"convolution_param {{ num_output: 6 kernel_size: 3 pad: 2 dilation: 2 group: 3"
         f" {FILL} }}", [randn(2, 6, 7, 7)], expected=conv_expected(pad=(2, 2), dil=(2, 2), group=3),
         id="conv-group-dilation"),
    Case("Convolution", f"convolution_param {{ num_output: 4 kernel_size: 3 stride: 2 group: 4 bias_term: false"
         f" {FILL} }}", [randn(2, 4, 7, 7)], expected=conv_expected(stride=(2, 2), group=4, bias=False),
         id="conv-depthwise-nobias"),
    Case("Convolution", f"convolution_param {{ num_output: 5 kernel_size: 1 {FILL} }}",
         [randn(2, 3, 4, 4)], expected=conv_expected(), id="conv-1x1"),
    Case("Deconvolution", f"convolution_param {{ num_output: 3 kernel_size: 3 stride: 2 pad: 1 {FILL} }}",
         [randn(2, 4, 4, 3)], expected=deconv_expected((1, 1), (2, 2)), id="deconv-stride2"),
    Case("Deconvolution", f"convolution_param {{ num_output: 4 kernel_size: 2 stride: 2 group: 2 {FILL} }}",
         [randn(1, 4, 3, 3)], expected=deconv_expected((0, 0), (2, 2), group=2), id="deconv-group"),
    Case("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 }", [distinct(2, 3, 7, 8)],
         expected=pool_expected("MAX", (3, 3), (2, 2), (0, 0)), id="max-3s2-ceil-overhang"),
    Case("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }", [distinct(2, 2, 6, 6)],
         expected=pool_expected("MAX", (3, 3), (2, 2), (1, 1)), id="max-pad"),
    Case("Pooling", "pooling_param { pool: MAX kernel_h: 2 kernel_w: 3 stride_h: 3 stride_w: 1 }",
         [distinct(1, 2, 8, 6)], expected=pool_expected("MAX", (2, 3), (3, 1), (0, 0)), id="max-rect-stride-gt-kernel"),
    Case("Pooling", "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }", [randn(2, 3, 7, 6)],
         expected=pool_expected("AVE", (3, 3), (2, 2), (1, 1)), id="ave-pad-overhang"),
    Case("Pooling", "pooling_param { pool: AVE kernel_size: 3 stride: 2 round_mode: FLOOR }",
         [randn(2, 3, 8, 8)], expected=pool_expected("AVE", (3, 3), (2, 2), (0, 0), floor=True), id="ave-floor"),
    Case("Pooling", "pooling_param { pool: AVE global_pooling: true }", [randn(2, 3, 5, 4)],
         expected=pool_expected("AVE", None, (1, 1), (0, 0), global_pooling=True), id="ave-global"),
    Case("Pooling", "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 avg_include_pad: false }",
         [randn(2, 3, 7, 6)], expected=pool_expected("AVE", (3, 3), (2, 2), (1, 1), include_pad=False),
         id="ave-pad-excluded"),
    Case("Pooling", "pooling_param { pool: AVE kernel_h: 3 kernel_w: 2 stride: 1 pad_h: 2 pad_w: 1 "
         "avg_include_pad: false }", [randn(1, 2, 4, 5)],
         expected=pool_expected("AVE", (3, 2), (1, 1), (2, 1), include_pad=False), id="ave-pad-excluded-rect"),
    Case("Im2col", "convolution_param { kernel_size: 2 stride: 1 pad: 1 }", [randn(2, 3, 3, 4)],
         expected=lambda x: [np.stack([np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))[:, c, i:i + 4, j:j + 5]
                                       for c in range(3) for i in range(2) for j in range(2)], axis=1)],
         id="im2col"),
    Case("Crop", "crop_param { axis: 2 offset: 1 offset: 2 }", [randn(2, 3, 6, 7), randn(2, 3, 3, 4, seed=1)],
         expected=lambda x, ref: [x[:, :, 1:4, 2:6]], check_bottom=[0], id="crop-offsets"),
    Case("Crop", "crop_param { axis: 1 offset: 1 }", [randn(2, 4, 5, 5), randn(2, 2, 3, 3, seed=1)],
         expected=lambda x, ref: [x[:, 1:3, 1:4, 1:4]], check_bottom=[0], id="crop-axis1"),
]

test_forward, test_gradient = case_tests(CASES)


def test_pooling_mask_top_and_test_phase_buffer():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    layer, bottom, top = setup_layer("Pooling", "pooling_param { pool: MAX kernel_size: 2 stride: 2 }", [x],
                                     n_top=2)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[1].data.ravel(), [5, 7, 13, 15])


def test_conv_in_test_phase_can_still_backward():
    case = Case("Convolution", f"convolution_param {{ num_output: 2 kernel_size: 3 {FILL} }}",
                [randn(2, 2, 5, 5)], phase=TEST)
    case.check_gradient()


def test_group_must_divide_channels():
    from caffepy.errors import LayerError
    with pytest.raises(LayerError, match=r"convolution_param.group: must divide the input channels \(3\)"):
        setup_layer("Convolution", "convolution_param { num_output: 4 kernel_size: 1 group: 2 }", [randn(1, 3, 2, 2)])


def test_kernel_larger_than_input_names_layer():
    from caffepy.errors import ShapeError
    with pytest.raises(ShapeError, match=r"layer 'layer' \(Convolution\).*does not fit the 2x2 input"):
        setup_layer("Convolution", "convolution_param { num_output: 1 kernel_size: 3 }", [randn(1, 1, 2, 2)])


def test_crop_too_large_is_a_shape_error():
    from caffepy.errors import ShapeError
    with pytest.raises(ShapeError, match="exceeds"):
        setup_layer("Crop", "crop_param { offset: 3 }", [randn(1, 1, 4, 4), randn(1, 1, 3, 3)])
