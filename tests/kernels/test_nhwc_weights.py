"""caffepy.kernels.nhwc.reverse_axes, which moves convolution weights and their gradients
between Caffe's order [O, C, kh * kw] and the channels-last GEMMs' [kh * kw, C, O]: against its
NumPy reference, on contiguous arrays, padded views and in-place accumulation."""
import numpy as np
import pytest

from caffepy.kernels import nhwc
from caffepy.kernels.reference import nhwc as ref

RNG = np.random.default_rng(77)

# (A, B, S): ResNet's 2048 x 1024 pointwise weights (power-of-two rows), 3x3 and 7x7 kernels,
# and sizes that end mid-tile in every axis; a pointwise gradient [1, C, O] (run as a 2-D
# transpose), whole tiles and not
SHAPES = [(2048, 1024, 1), (64, 3, 49), (96, 48, 25), (17, 5, 3), (33, 70, 2), (1, 1, 1),
          (1, 256, 64), (1, 37, 21)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reverse_axes_writes_and_adds(shape):
    src = RNG.standard_normal(shape, dtype=np.float32)
    want = ref.reverse_axes(src)
    dst = np.full(want.shape, np.nan, np.float32)
    nhwc.reverse_axes(src, dst)
    np.testing.assert_array_equal(dst, want)
    start = RNG.standard_normal(want.shape, dtype=np.float32)
    acc = start.copy()
    nhwc.reverse_axes(src, acc, True)
    np.testing.assert_allclose(acc, start + want, rtol=1e-6)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_reverse_axes_on_strided_views(shape):
    """The direct algorithm's padded weight matrix as destination, a sliced gradient as source;
    nothing outside the views is touched."""
    A, B, S = shape
    padded = np.zeros((S * B + 3, A + 5), np.float32)
    view = padded[:S * B, :A].reshape(S, B, A)
    src = RNG.standard_normal((A, B, S + 4), dtype=np.float32)[:, :, :S]
    nhwc.reverse_axes(src, view)
    np.testing.assert_array_equal(view, ref.reverse_axes(src))
    assert not padded[:, A:].any() and not padded[S * B:].any()
    nhwc.reverse_axes(src, view, True)
    np.testing.assert_allclose(view, 2 * ref.reverse_axes(src), rtol=1e-6)


def test_reverse_axes_refuses_a_wrong_destination():
    with pytest.raises(ValueError, match="dst: needs shape"):
        nhwc.reverse_axes(np.zeros((4, 3, 2), np.float32), np.zeros((2, 4, 3), np.float32))
