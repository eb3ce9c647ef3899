"""caffe.coord_map: spatial maps between NetSpec tops and the FCN crop helper, checked against
maps worked out by hand from the layer formulas and against the shapes a built net produces."""
import numpy as np
import pytest

import caffepy as caffe
from caffepy import layers as L, params as P
from caffepy.coord_map import (AxisMismatchException, UndefinedMapException, compose, coord_map_from_to,
                               crop, inverse)
from caffepy.errors import CaffepyError


def conv_pool_deconv(ks=3, stride=1, pad=0, pool=2, dstride=2, dpad=0, size=100):
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, size, size]))
    n.conv = L.Convolution(n.data, num_output=2, kernel_size=ks, stride=stride, pad=pad)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=pool, stride=pool)
    dks = [2 * s for s in dstride] if isinstance(dstride, list) else 2 * dstride
    n.deconv = L.Deconvolution(n.pool, num_output=2, kernel_size=dks, stride=dstride, pad=dpad)
    return n


def same(m1, m2):
    return m1[0] == m2[0] and np.array_equal(m1[1], m2[1]) and np.array_equal(m1[2], m2[2])


def test_single_layer_maps():
    n = conv_pool_deconv(ks=5, stride=2, pad=1)
    # conv: a = 1/s, b = (p - (k-1)/2) / s; the map from data to conv
    ax, a, b = coord_map_from_to(n.conv, n.data)
    # that is the inverse: data coordinate = s * conv coordinate + ((k-1)/2 - p)
    assert ax == 1 and a == 2 and b == 1
    ax, a, b = coord_map_from_to(n.data, n.conv)
    assert ax == 1 and a == 0.5 and b == -0.5


@pytest.mark.parametrize("kwargs, expected_b", [
    (dict(), 0),                       # conv 3 (-1), pool 2 (-0.25 * 2), deconv 4 stride 2 (+1.5): 0
    (dict(pool=4, dstride=4), -1),
    (dict(pad=3), -3),                 # conv padding shifts the output by the pad
    (dict(dpad=3), 3),                 # deconv padding shifts the other way
    (dict(pad=3, dpad=3), 0),
])
def test_conv_pool_deconv_maps(kwargs, expected_b):
    n = conv_pool_deconv(**kwargs)
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    assert ax == 1 and np.all(a == 1) and np.all(b == expected_b)


def test_pointwise_layers_and_1x1_conv_keep_the_map():
    n = conv_pool_deconv(pool=4, dstride=4)
    base = coord_map_from_to(n.deconv, n.data)
    n.relu = L.ReLU(n.deconv)
    n.drop = L.Dropout(n.relu)
    n.one = L.Convolution(n.drop, num_output=2, kernel_size=1)
    for top in (n.relu, n.drop, n.one):
        assert same(coord_map_from_to(top, n.data), base)


def test_anisotropic_parameters_map_each_axis_on_its_own():
    n3, n5 = conv_pool_deconv(ks=3, stride=1, pad=0), conv_pool_deconv(ks=5, stride=2, pad=10)
    _, a3, b3 = coord_map_from_to(n3.deconv, n3.data)
    _, a5, b5 = coord_map_from_to(n5.deconv, n5.data)
    n = conv_pool_deconv(ks=[3, 5], stride=[1, 2], pad=[0, 10])
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    assert ax == 1 and len(a) == len(b) == 2
    assert (a[0], b[0]) == (a3[0], b3[0]) and (a[1], b[1]) == (a5[0], b5[0])
    # kernel_h/_w, stride_h/_w, pad_h/_w give the same (pycaffe refuses them)
    m = caffe.NetSpec()
    m.data = L.Input(shape=dict(dim=[1, 1, 100, 100]))
    m.conv = L.Convolution(m.data, num_output=2, kernel_h=3, kernel_w=5, stride_h=1, stride_w=2, pad_h=0, pad_w=10)
    m.pool = L.Pooling(m.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    m.deconv = L.Deconvolution(m.pool, num_output=2, kernel_size=4, stride=2)
    _, a2, b2 = coord_map_from_to(m.deconv, m.data)
    np.testing.assert_array_equal(a2, a)
    np.testing.assert_array_equal(b2, b)


def test_dilation_widens_the_kernel():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 20, 20]))
    n.conv = L.Convolution(n.data, num_output=1, kernel_size=3, dilation=2)   # extent 5
    assert same(coord_map_from_to(n.conv, n.data), (1, [1], [2]))


def test_multiple_bottoms_map_alike():
    n = caffe.NetSpec()
    n.a = L.Input(shape=dict(dim=[1, 1, 30, 30]))
    n.b = L.Input(shape=dict(dim=[1, 1, 20, 20]))
    n.ca, n.cb = L.Convolution(n.a, n.b, ntop=2, num_output=1, kernel_size=5, stride=2)
    assert same(coord_map_from_to(n.ca, n.a), coord_map_from_to(n.cb, n.b))


def test_crop_of_a_crop_adds_the_offset():
    n = conv_pool_deconv()
    _, a, b = coord_map_from_to(n.deconv, n.data)
    n.crop = L.Crop(n.deconv, n.data, axis=2, offset=4)
    ax, a2, b2 = coord_map_from_to(n.crop, n.data)
    assert ax == 1 and a2 == a and b2 == b + 4


def fcn():
    """FCN-style: conv pad 100, two 2x poolings, a 1x1 score, 4x upsampling back to the input."""
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3, 64, 64]))
    n.conv1 = L.Convolution(n.data, num_output=4, kernel_size=3, pad=100, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.conv1, in_place=True)
    n.pool1 = L.Pooling(n.relu1, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.conv2 = L.Convolution(n.pool1, num_output=4, kernel_size=3, weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.score = L.Convolution(n.pool2, num_output=5, kernel_size=1)
    n.upscore = L.Deconvolution(n.score, convolution_param=dict(num_output=5, kernel_size=8, stride=4,
                                                                 bias_term=False))
    return n


def test_crop_helper_aligns_an_fcn_output_with_its_input():
    n = fcn()
    # by hand: data -> upscore is y = x + 99 (conv1 +99, pool1 -0.25, conv2 -1, pool2 -0.25, upscore x4 +3.5)
    ax, a, b = coord_map_from_to(n.upscore, n.data)
    assert ax == 1 and a == 1 and b == -99
    n.score_crop = crop(n.upscore, n.data)
    layer = n.to_proto().layer[-1]
    assert layer.type == "Crop" and list(layer.bottom) == ["upscore", "data"]
    assert layer.crop_param.axis == 2 and list(layer.crop_param.offset) == [99]
    net = caffe.Net(n.to_proto(), caffe.TEST)
    assert net.blobs["upscore"].data.shape == (1, 5, 264, 264)
    assert net.blobs["score_crop"].data.shape == (1, 5, 64, 64)
    net.forward(data=np.random.default_rng(0).normal(size=(1, 3, 64, 64)).astype(np.float32))
    np.testing.assert_array_equal(net.blobs["score_crop"].data, net.blobs["upscore"].data[:, :, 99:163, 99:163])


def test_mistakes_raise_pycaffes_exception_types():
    n = conv_pool_deconv()
    n.ip = L.InnerProduct(n.deconv, num_output=3)
    with pytest.raises(RuntimeError, match="could not compute the map between the tops"):
        coord_map_from_to(n.ip, n.data)
    with pytest.raises(CaffepyError):
        coord_map_from_to(n.ip, n.data)
    odd = conv_pool_deconv(pool=3, dstride=2)          # pooled 3x, upsampled 2x
    with pytest.raises(AssertionError, match="scale mismatch"):
        crop(odd.deconv, odd.data)
    small = conv_pool_deconv(dpad=10)                  # the upsampled output is smaller than the input
    with pytest.raises(AssertionError, match="cannot crop a negative offset"):
        crop(small.deconv, small.data)
    with pytest.raises(UndefinedMapException):
        from caffepy.coord_map import coord_map
        coord_map(n.ip.fn)
    with pytest.raises(AxisMismatchException):
        compose((1, 1, 0), (2, 1, 0))
    assert inverse((1, 2.0, 3.0)) == (1, 0.5, -1.5)
