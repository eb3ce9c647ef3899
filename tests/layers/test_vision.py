"""Vision layers against naive NumPy loops written for these tests."""
import math

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


def spp_expected(levels, kind):
    """Each level: Caffe's SPP window (kernel ceil(size / bins) as stride, padding half the
    shortfall, rounded up) pooled with pool_expected, flattened and concatenated."""
    def expected(x):
        n, _, h, w = x.shape
        parts = []
        for level in range(levels):
            bins = 2 ** level
            k = (-(-h // bins), -(-w // bins))
            pad = ((k[0] * bins - h + 1) // 2, (k[1] * bins - w + 1) // 2)
            parts.append(pool_expected(kind, k, k, pad)(x)[0])
        return [parts[0] if levels == 1 else np.concatenate([p.reshape(n, -1) for p in parts], axis=1)]
    return expected


def c_round(v):
    return math.floor(v + 0.5) if v >= 0 else -math.floor(-v + 0.5)


def roi_pool_expected(pooled_h, pooled_w, scale):
    """Fast R-CNN's ROI max pooling, loop by loop, in float32 as Caffe computes the bins."""
    f32 = np.float32

    def expected(x, rois):
        n, c, h, w = x.shape
        out = np.zeros((len(rois), c, pooled_h, pooled_w))
        for r, (b, x1, y1, x2, y2) in enumerate(rois):
            sx, sy = c_round(f32(x1) * f32(scale)), c_round(f32(y1) * f32(scale))
            ex, ey = c_round(f32(x2) * f32(scale)), c_round(f32(y2) * f32(scale))
            bh = f32(max(ey - sy + 1, 1)) / f32(pooled_h)
            bw = f32(max(ex - sx + 1, 1)) / f32(pooled_w)
            for i in range(pooled_h):
                for j in range(pooled_w):
                    hs = min(max(math.floor(f32(i) * bh) + sy, 0), h)
                    he = min(max(math.ceil(f32(i + 1) * bh) + sy, 0), h)
                    ws = min(max(math.floor(f32(j) * bw) + sx, 0), w)
                    we = min(max(math.ceil(f32(j + 1) * bw) + sx, 0), w)
                    if he > hs and we > ws:
                        out[r, :, i, j] = x[int(b), :, hs:he, ws:we].max(axis=(1, 2))
        return [out]
    return expected


def reorg_loops(x, stride, forward):
    """Darknet's reorg as Intel Caffe runs it, element by element: for each (n, k, j, i) of a
    N x C x H x W grid (the bottom's shape), element (n, k % C', j s + (k // C') // s,
    i s + (k // C') % s) of a N x C' x H s x W s array, C' = C / s^2, is paired with it;
    `forward` copies grid <- array (Reorg without reverse), else array <- grid."""
    n, c, h, w = x.shape
    s, c2 = stride, c // (stride * stride)
    flat_in = x.reshape(-1)
    out = np.zeros(x.size)
    for b in range(n):
        for k in range(c):
            for j in range(h):
                for i in range(w):
                    grid = i + w * (j + h * (k + c * b))
                    off = k // c2
                    arr = (i * s + off % s) + w * s * ((j * s + off // s) + h * s * (k % c2 + c2 * b))
                    if forward:
                        out[grid] = flat_in[arr]
                    else:
                        out[arr] = flat_in[grid]
    return out


def psroi_expected(dim, k, scale):
    """R-FCN's position-sensitive average pooling, bin by bin, in float32 as Intel computes it."""
    f32 = np.float32

    def expected(x, rois):
        n, c, h, w = x.shape
        out = np.zeros((len(rois), dim, k, k))
        for r, (b, x1, y1, x2, y2) in enumerate(rois):
            sx, sy = f32(c_round(x1)) * f32(scale), f32(c_round(y1)) * f32(scale)
            ex, ey = f32(c_round(x2) + 1) * f32(scale), f32(c_round(y2) + 1) * f32(scale)
            bh, bw = max(ey - sy, f32(0.1)) / f32(k), max(ex - sx, f32(0.1)) / f32(k)
            for ct in range(dim):
                for i in range(k):
                    for j in range(k):
                        hs = min(max(math.floor(f32(i) * bh + sy), 0), h)
                        he = min(max(math.ceil(f32(i + 1) * bh + sy), 0), h)
                        ws = min(max(math.floor(f32(j) * bw + sx), 0), w)
                        we = min(max(math.ceil(f32(j + 1) * bw + sx), 0), w)
                        if he > hs and we > ws:
                            out[r, ct, i, j] = x[int(b), (ct * k + i) * k + j, hs:he, ws:we].mean()
        return [out]
    return expected


# the last ROI lies past the 6 x 7 map (all bins empty); the third is one pixel
PSROIS = np.array([[0, 0, 0, 9, 7], [1, 3, 2, 13, 11], [1, 5, 5, 5, 5], [0, 2.5, 1.5, 6.4, 12.6],
                   [0, 30, 30, 40, 40]], np.float32)


ROIS = np.array([[0, 0, 0, 10, 8], [1, 5, 3, 19, 15], [1, 6, 6, 7, 7], [0, 13, 9, 40, 30]], np.float32)

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
    Case("SPP", "spp_param { pyramid_height: 3 }", [distinct(2, 3, 7, 9)], expected=spp_expected(3, "MAX"),
         id="spp-max-3-levels"),
    Case("SPP", "spp_param { pyramid_height: 2 pool: AVE }", [randn(2, 3, 5, 6)], expected=spp_expected(2, "AVE"),
         id="spp-ave-2-levels"),
    Case("SPP", "spp_param { pyramid_height: 1 }", [distinct(2, 3, 5, 6)], expected=spp_expected(1, "MAX"),
         id="spp-one-level-4d"),
    Case("ROIPooling", "roi_pooling_param { pooled_h: 2 pooled_w: 3 spatial_scale: 0.5 }",
         [distinct(2, 3, 8, 10), ROIS], expected=roi_pool_expected(2, 3, 0.5), check_bottom=[0],
         id="roi-pooling"),
    Case("ROIPooling", "roi_pooling_param { pooled_size: 3 spatial_scale: 0.25 }",
         [distinct(2, 2, 6, 7), ROIS], expected=roi_pool_expected(3, 3, 0.25), check_bottom=[0],
         id="roi-pooling-pooled-size"),
    Case("PSROIPooling", "psroi_pooling_param { spatial_scale: 0.5 output_dim: 2 group_size: 3 }",
         [randn(2, 18, 6, 7), PSROIS], expected=psroi_expected(2, 3, 0.5), check_bottom=[0], id="psroi-pooling"),
    Case("PSROIPooling", "psroi_pooling_param { spatial_scale: 0.25 output_dim: 3 group_size: 2 }",
         [randn(2, 12, 5, 4, seed=3), PSROIS], expected=psroi_expected(3, 2, 0.25), check_bottom=[0],
         id="psroi-pooling-k2"),
    Case("Reorg", "reorg_param { stride: 2 }", [randn(2, 8, 4, 6)],
         expected=lambda x: [reorg_loops(x, 2, True).reshape(2, 32, 2, 3)], id="reorg"),
    Case("Reorg", "reorg_param { stride: 2 reverse: true }", [randn(2, 8, 4, 6)],
         expected=lambda x: [reorg_loops(x, 2, False).reshape(2, 2, 8, 12)], id="reorg-reverse"),
    Case("Reorg", "reorg_param { stride: 3 }", [randn(1, 9, 3, 6)],
         expected=lambda x: [reorg_loops(x, 3, True).reshape(1, 81, 1, 2)], id="reorg-stride3"),
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


# -- SPP, ROIPooling, Reorg -----------------------------------------------------------------------
def test_spp_refuses_a_level_finer_than_the_input():
    # 4x4 bins over 5 rows: kernel 2, padding 2, which Caffe's pooling refuses too
    with pytest.raises(Exception, match=r"spp_param.pyramid_height: level 2 \(4x4 bins\) does not fit "
                                        r"the 5x8 input, got 3"):
        setup_layer("SPP", "spp_param { pyramid_height: 3 }", [randn(1, 1, 5, 8)])
    with pytest.raises(Exception, match=r"spp_param.pool: only MAX and AVE are supported, got STOCHASTIC"):
        setup_layer("SPP", "spp_param { pyramid_height: 2 pool: STOCHASTIC }", [randn(1, 1, 8, 8)])


def test_roi_pooling_rounds_halves_away_from_zero_and_routes_diffs_to_the_maxima():
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    # x1 = 2.5 -> 3 (C's round), not 2 (NumPy's rint): the bin is column 3 only
    layer, bottom, top = setup_layer("ROIPooling", "roi_pooling_param { pooled_h: 1 pooled_w: 1 spatial_scale: 0.5 }",
                                     [x, np.array([[1, 5, 0, 7, 1]], np.float32)])
    layer.forward(bottom, top)
    assert top[0].data.item() == x[1, 0, 1, 3]
    top[0].diff[...] = 2
    layer.backward(top, [True, False], bottom)
    assert bottom[0].diff[1, 0, 1, 3] == 2 and bottom[0].diff.sum() == 2
    bottom[1].data[0, 0] = 2
    with pytest.raises(Exception, match=r"bottom\[1\]: roi batch indices must lie in \[0, 2\), got 2.0"):
        layer.forward(bottom, top)


def test_reorg_refuses_shapes_the_stride_does_not_divide_and_in_place():
    with pytest.raises(Exception, match=r"reorg_param.stride: needs channels divisible by 4 and height, "
                                        r"width by 2, got 2 for a 6x4x4 bottom"):
        setup_layer("Reorg", "reorg_param { stride: 2 }", [randn(1, 6, 4, 4)])
    with pytest.raises(Exception, match=r"reorg_param.stride: is required"):
        setup_layer("Reorg", "", [randn(1, 4, 4, 4)])


@pytest.mark.parametrize("type_,params,match", [
    ("Deconvolution", "convolution_param { num_output: 2 kernel_size: 1 coeff: 1 }",
     r"convolution_param.fusion_type: a fused Eltwise SUM is run by Convolution, not Deconvolution"),
    ("Pooling", "pooling_param { kernel_size_3d: 2 }",
     r"pooling_param.kernel_size_3d: caffepy supports 2-D pooling \(Intel Caffe's 3-D pooling is not supported\)"),
])
def test_intel_convolution_and_pooling_extensions_are_refused(type_, params, match):
    with pytest.raises(Exception, match=match):
        setup_layer(type_, params, [randn(1, 2, 4, 4)])


def test_blocked_convolution_checks_the_fusions_with_the_same_words():
    with pytest.raises(Exception, match=r"layer 'layer' \(Convolution\): convolution_param.fusion_type: SUM_FUSION "
                                        r"takes two bottoms \(the input and the summand\) and one top"):
        setup_layer("Convolution", "convolution_param { num_output: 8 kernel_size: 1 fusion_type: SUM_FUSION }",
                    [randn(1, 8, 4, 4)], layout="blocked")


def test_psroi_pooling_averages_each_bins_own_channel_and_checks_its_inputs():
    # channel (c k + i) k + j holds the value 100 c + 10 i + j everywhere: each bin shows its index
    k, dim = 2, 2
    x = np.zeros((1, dim * k * k, 4, 4), np.float32)
    for c in range(dim):
        for i in range(k):
            for j in range(k):
                x[0, (c * k + i) * k + j] = 100 * c + 10 * i + j
    layer, bottom, top = setup_layer("PSROIPooling", "psroi_pooling_param { spatial_scale: 1 output_dim: 2 group_size: 2 }",
                                     [x, np.array([[0, 0, 0, 3, 3]], np.float32)])
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data[0], [[[0, 1], [10, 11]], [[100, 101], [110, 111]]])
    top[0].diff[...] = 4
    layer.backward(top, [True, False], bottom)
    # each 2 x 2 bin spreads its diff over its 4 cells of its own channel
    assert np.all(bottom[0].diff.sum(axis=(2, 3)) == 4) and bottom[0].diff.max() == 1
    with pytest.raises(Exception, match=r"bottom\[0\]: needs N x 8 x H x W score maps \(output_dim 2 x group_size "
                                        r"2\^2 channels\), got \(1, 6, 4, 4\)"):
        setup_layer("PSROIPooling", "psroi_pooling_param { spatial_scale: 1 output_dim: 2 group_size: 2 }",
                    [x[:, :6], np.array([[0, 0, 0, 3, 3]], np.float32)])
    with pytest.raises(Exception, match=r"psroi_pooling_param.group_size: is required"):
        setup_layer("PSROIPooling", "psroi_pooling_param { spatial_scale: 1 output_dim: 2 }",
                    [x, np.array([[0, 0, 0, 3, 3]], np.float32)])
