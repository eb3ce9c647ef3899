"""Loss layers and Accuracy against float64 loop references written from Caffe's formulas."""
import numpy as np
import pytest

from caffepy.errors import LayerError, ShapeError
from layer_cases import Case, case_tests, randn, setup_layer


def labels(shape, classes, seed=1, ignore=None, ignore_every=3):
    lab = np.random.default_rng(seed).integers(0, classes, size=shape).astype(np.float32)
    if ignore is not None:
        lab.reshape(-1)[::ignore_every] = ignore
    return lab


def _norm(mode, outer, inner, valid):
    n = {"VALID": valid, "FULL": outer * inner, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return max(1.0, float(n))


def _rows(x, axis):
    """(outer * inner, classes) rows in the label order, plus outer and inner."""
    axis = axis % x.ndim
    outer, inner = int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis + 1:]))
    return np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis]), outer, inner


def softmax_ref(x, axis=1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_loss_ref(axis=1, ignore=None, mode="VALID"):
    def ref(x, lab):
        rows, outer, inner = _rows(x, axis)
        total, count = 0.0, 0
        for r, l in zip(rows, lab.reshape(-1).astype(int)):
            if ignore is not None and l == ignore:
                continue
            total -= r[l] - (r.max() + np.log(np.sum(np.exp(r - r.max()))))
            count += 1
        return [np.array(total / _norm(mode, outer, inner, count))]
    return ref


def sigmoid_ce_ref(ignore=None, mode="BATCH_SIZE"):
    def ref(x, t):
        total, count = 0.0, 0
        for xi, ti in zip(x.reshape(-1), t.reshape(-1)):
            if ignore is not None and int(ti) == ignore:
                continue
            p = 1.0 / (1.0 + np.exp(-xi))
            total -= ti * np.log(p) + (1 - ti) * np.log(1 - p)
            count += 1
        return [np.array(total / _norm(mode, x.shape[0], x[0].size, count))]
    return ref


def hinge_ref(power):
    def ref(x, lab):
        x = x.reshape(x.shape[0], -1)
        total = 0.0
        for i, l in enumerate(lab.reshape(-1).astype(int)):
            for k in range(x.shape[1]):
                s = 1.0 if k == l else -1.0
                total += max(0.0, 1.0 - s * x[i, k]) ** power
        return [np.array(total / x.shape[0])]
    return ref


def contrastive_ref(margin, legacy):
    def ref(a, b, y):
        total = 0.0
        for ai, bi, yi in zip(a.reshape(len(a), -1), b.reshape(len(b), -1), y.reshape(-1)):
            d2 = float(np.sum((ai - bi) ** 2))
            if int(yi):
                total += d2
            elif legacy:
                total += max(margin - d2, 0.0)
            else:
                total += max(margin - np.sqrt(d2), 0.0) ** 2
        return [np.array(total / len(a) / 2)]
    return ref


def infogain_ref(H, axis=1, ignore=None, mode="VALID"):
    def ref(x, lab, h=None):
        m = (H if h is None else h).reshape(x.shape[axis], x.shape[axis])
        rows, outer, inner = _rows(x, axis)
        total, count = 0.0, 0
        for r, l in zip(rows, lab.reshape(-1).astype(int)):
            if ignore is not None and l == ignore:
                continue
            p = np.exp(r - r.max())
            p /= p.sum()
            total -= np.dot(m[l], np.log(p))
            count += 1
        return [np.array(total / _norm(mode, outer, inner, count)), softmax_ref(x, axis)][:2]
    return ref


def accuracy_ref(top_k=1, axis=1, ignore=None, per_class=False):
    def ref(x, lab):
        rows, _, _ = _rows(x, axis)
        classes = rows.shape[1]
        hits, count = 0, 0
        seen, good = np.zeros(classes), np.zeros(classes)
        for r, l in zip(rows, lab.reshape(-1).astype(int)):
            if ignore is not None and l == ignore:
                continue
            rank = sum(1 for k in range(classes) if k != l and r[k] >= r[l])
            ok = rank < top_k
            hits += ok
            count += 1
            seen[l] += 1
            good[l] += ok
        out = [np.array(hits / count if count else 0.0)]
        if per_class:
            out.append(np.where(seen > 0, good / np.maximum(seen, 1), 0.0))
        return out
    return ref


def away_from(x, points, gap=0.1):
    """Move values within `gap` of a kink out of the gradient checker's reach."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap) * 1.5
    return x


def smooth_l1_ref(sigma=1.0, normalizer=None):
    """Fast R-CNN's loss element by element: d = w_in (x - t), 0.5 (sigma d)^2 inside
    |d| < 1 / sigma^2, |d| - 0.5 / sigma^2 outside, times w_out, summed; over N or `normalizer`."""
    def ref(x, t, w_in=None, w_out=None):
        total = 0.0
        for i, (xi, ti) in enumerate(zip(x.reshape(-1), t.reshape(-1))):
            d = (xi - ti) * (1.0 if w_in is None else w_in.reshape(-1)[i])
            f = 0.5 * sigma * sigma * d * d if abs(d) < 1.0 / sigma ** 2 else abs(d) - 0.5 / sigma ** 2
            total += f * (1.0 if w_out is None else w_out.reshape(-1)[i])
        return [np.array(total / (x.shape[0] if normalizer is None else normalizer))]
    return ref


def smooth_l1_ohem_ref(normalizer):
    """R-FCN's OHEM smooth L1 (sigma 1): the loss over `normalizer(x)`, and each position's loss
    summed over the channels (N x 1 x spatial)."""
    def ref(x, t, w=None):
        n, c = x.shape[0], x.shape[1]
        per = np.zeros((n, 1) + x.shape[2:] if x.ndim > 2 else (n, 1, 1, 1))
        flat_per = per.reshape(n, -1)
        for i in range(n):
            for ch in range(c):
                for s in range(flat_per.shape[1]):
                    idx = (i * c + ch) * flat_per.shape[1] + s
                    d = (x.reshape(-1)[idx] - t.reshape(-1)[idx]) * (1.0 if w is None else w.reshape(-1)[idx])
                    flat_per[i, s] += 0.5 * d * d if abs(d) < 1 else abs(d) - 0.5
        return [np.array(per.sum() / normalizer(x)), per]
    return ref


def softmax_ohem_ref(ignore=None):
    """SoftmaxWithLoss's loss and probabilities, then -log p[label] per label (0 where ignored)."""
    def ref(x, lab):
        prob = softmax_ref(x)
        per = np.zeros(lab.shape)
        for i, l in enumerate(lab.reshape(-1).astype(int)):
            if ignore is None or l != ignore:
                per.reshape(-1)[i] = -np.log(max(prob[i, l], np.finfo(np.float32).tiny))
        return softmax_loss_ref(1, ignore)(x, lab) + [prob, per]
    return ref


def box_annotator_ref(roi_per_img, ignore):
    """Keep each image's roi_per_img highest-loss ROIs (ties: lower index first)."""
    def ref(rois, loss, lab, weights):
        order = sorted(range(len(rois)), key=lambda i: (-loss.reshape(-1)[i], i))
        left, out_lab, out_w = {}, np.full(lab.shape, float(ignore)), np.zeros(weights.shape)
        for i in order:
            image = int(rois[i, 0])
            left.setdefault(image, roi_per_img)
            if left[image] > 0:
                left[image] -= 1
                out_lab.reshape(-1)[i] = lab.reshape(-1)[i]
                out_w[i] = weights[i]
        return [out_lab, out_w]
    return ref


def regression_inputs(n, c, sigma, seed, tail=()):
    """x, t, w_in, w_out with every |w_in (x - t)| at least 0.05 from the smooth L1's seam at
    1 / sigma^2 (its second derivative jumps there: no central difference agrees across it)."""
    gen = np.random.default_rng(seed)
    t = gen.standard_normal((n, c) + tail).astype(np.float32)
    w_in = gen.choice([0.0, 1.0, 2.0], size=t.shape).astype(np.float32)
    d = away_from(gen.standard_normal(t.shape) * 0.5, [-1 / sigma ** 2, 1 / sigma ** 2], 0.05)
    x = (t + d / np.where(w_in == 0, 1, w_in)).astype(np.float32)
    w_out = gen.uniform(0.2, 1.5, t.shape).astype(np.float32)
    return x, t, w_in, w_out


SL1 = regression_inputs(4, 8, 3.0, seed=40)
SL1_PLAIN = regression_inputs(3, 6, 1.0, seed=41)
SL1_MAPS = regression_inputs(1, 8, 1.0, seed=42, tail=(3, 2))
OHEM = regression_inputs(5, 8, 1.0, seed=43)
OHEM_W = (OHEM[2] > 0).astype(np.float32)        # R-FCN's 0 / 1 weights
ROIS5 = np.array([[0, 1, 1, 5, 5], [1, 2, 2, 6, 6], [0, 0, 0, 3, 3], [1, 4, 4, 9, 9], [0, 2, 2, 8, 8],
                  [1, 1, 0, 3, 3], [0, 5, 5, 7, 7]], np.float32)
ROI_LOSS = np.array([0.5, 2.0, 0.5, 0.1, 3.0, 2.0, 0.5], np.float32).reshape(7, 1, 1, 1)


X45 = randn(4, 5, seed=3, scale=2.0)
X_SP = randn(2, 4, 3, 2, seed=4, scale=2.0)
H5 = np.abs(randn(1, 1, 5, 5, seed=8)) + 0.1
PROBS = softmax_ref(randn(6, 5, seed=9).astype(np.float64)).astype(np.float32)
PAIR_A, PAIR_B = randn(6, 3, 1, 1, seed=10), randn(6, 3, 1, 1, seed=11)
SIMILAR = np.array([1, 0, 1, 0, 0, 0], np.float32).reshape(6, 1, 1, 1)
TIES = np.array([[1, 2, 2, 0], [3, 3, 3, 3], [0, 1, 2, 3], [5, 1, 5, 1]], np.float32)


def _sp_cases():
    out = []
    lab_ign = labels((2, 1, 3, 2), 4, seed=2, ignore=255)
    for mode in ("VALID", "FULL", "BATCH_SIZE", "NONE"):
        params = f"loss_param {{ ignore_label: 255 normalization: {mode} }}"
        out.append(Case("SoftmaxWithLoss", params, [X_SP, lab_ign], check_bottom=[0],
                        expected=softmax_loss_ref(1, 255, mode), id=f"SoftmaxWithLoss:{mode}"))
    return out


CASES = [
    Case("SoftmaxWithLoss", "", [X45, labels(4, 5)], check_bottom=[0], expected=softmax_loss_ref()),
    *_sp_cases(),
    Case("SoftmaxWithLoss", "loss_param { normalize: false }", [X_SP, labels((2, 3, 2), 4, seed=5)],
         check_bottom=[0], expected=softmax_loss_ref(1, None, "BATCH_SIZE"),
         id="SoftmaxWithLoss:normalize-false"),
    Case("SoftmaxWithLoss", "loss_param { normalize: true ignore_label: 1 }",
         [X_SP, labels((2, 3, 2), 4, seed=5)],
         check_bottom=[0], expected=softmax_loss_ref(1, 1, "VALID"), id="SoftmaxWithLoss:normalize-true"),
    Case("SoftmaxWithLoss", "softmax_param { axis: -1 }", [X_SP, labels((2, 4, 3), 2, seed=6)],
         check_bottom=[0], expected=softmax_loss_ref(-1), id="SoftmaxWithLoss:axis-1"),
    Case("SoftmaxWithLoss", "softmax_param { axis: 2 }", [X_SP, labels((2, 4, 2), 3, seed=7)],
         check_bottom=[0], expected=softmax_loss_ref(2), id="SoftmaxWithLoss:axis2"),
    Case("SoftmaxWithLoss", "", [X45, labels(4, 5)], n_top=2, grad=False,
         expected=lambda x, l: softmax_loss_ref()(x, l) + [softmax_ref(x)], id="SoftmaxWithLoss:prob-top"),
    # extreme logits: finite loss, probability underflow clamped as Caffe's log(max(p, FLT_MIN))
    Case("SoftmaxWithLoss", "", [np.array([[0, 200, -200]], np.float32), np.array([2], np.float32)],
         grad=False, expected=lambda x, l: [np.array(-np.log(np.finfo(np.float32).tiny))],
         id="SoftmaxWithLoss:saturated", rtol=1e-5),

    Case("SigmoidCrossEntropyLoss", "", [randn(3, 4, 2, seed=12, scale=2.0),
                                         np.random.default_rng(13).random((3, 4, 2)).astype(np.float32)],
         check_bottom=[0], expected=sigmoid_ce_ref()),
    *[Case("SigmoidCrossEntropyLoss", f"loss_param {{ ignore_label: -1 normalization: {mode} }}",
           [randn(3, 4, 2, seed=14, scale=2.0), labels((3, 4, 2), 2, seed=15, ignore=-1)],
           check_bottom=[0], expected=sigmoid_ce_ref(-1, mode), id=f"SigmoidCrossEntropyLoss:{mode}")
      for mode in ("VALID", "FULL", "BATCH_SIZE", "NONE")],
    Case("SigmoidCrossEntropyLoss", "loss_param { normalize: true }",
         [randn(3, 5, seed=16), labels((3, 5), 2, seed=17)], check_bottom=[0],
         expected=sigmoid_ce_ref(None, "VALID"), id="SigmoidCrossEntropyLoss:normalize"),
    Case("SigmoidCrossEntropyLoss", "", [np.array([[80.0, -80.0, 0.0]], np.float32),
                                         np.array([[0.0, 1.0, 0.5]], np.float32)],
         grad=False, expected=lambda x, t: [np.array(160.0 + np.log(2.0))],
         id="SigmoidCrossEntropyLoss:extreme"),

    Case("EuclideanLoss", "", [randn(4, 3, 2, seed=18), randn(4, 3, 2, seed=19)],
         expected=lambda a, b: [np.array(np.sum((a - b) ** 2) / 4 / 2)]),
    Case("EuclideanLoss", "", [randn(4, 6, seed=18), randn(4, 2, 3, seed=19)],
         expected=lambda a, b: [np.array(np.sum((a - b.reshape(4, 6)) ** 2) / 4 / 2)],
         id="EuclideanLoss:shapes"),

    Case("HingeLoss", "", [away_from(randn(5, 4, seed=20, scale=1.5), [-1, 1]), labels(5, 4, seed=21)],
         check_bottom=[0], expected=hinge_ref(1)),
    Case("HingeLoss", "hinge_loss_param { norm: L2 }",
         [away_from(randn(5, 2, 2, seed=22, scale=1.5), [-1, 1]), labels(5, 4, seed=23)],
         check_bottom=[0], expected=hinge_ref(2)),

    Case("ContrastiveLoss", "contrastive_loss_param { margin: 2.5 }", [PAIR_A, PAIR_B, SIMILAR],
         check_bottom=[0, 1], expected=contrastive_ref(2.5, False)),
    Case("ContrastiveLoss", "contrastive_loss_param { margin: 5 legacy_version: true }",
         [PAIR_A, PAIR_B, SIMILAR], check_bottom=[0, 1], expected=contrastive_ref(5.0, True)),

    Case("InfogainLoss", "", [X45, labels(4, 5, seed=24), H5], check_bottom=[0],
         expected=lambda x, l, h: infogain_ref(H5)(x, l, h)[:1]),
    Case("InfogainLoss", "infogain_loss_param { axis: 2 } loss_param { ignore_label: 0 normalization: FULL }",
         [randn(2, 3, 5, seed=25), labels((2, 3), 5, seed=26), H5], check_bottom=[0], n_top=2,
         expected=lambda x, l, h: infogain_ref(H5, 2, 0, "FULL")(x, l, h), id="InfogainLoss:axis2-prob-top",
         grad=False),
    Case("InfogainLoss",
         "infogain_loss_param { axis: 2 } loss_param { ignore_label: 0 normalization: BATCH_SIZE }",
         [randn(2, 3, 5, seed=25), labels((2, 3), 5, seed=26), H5], check_bottom=[0],
         expected=lambda x, l, h: infogain_ref(H5, 2, 0, "BATCH_SIZE")(x, l, h)[:1], id="InfogainLoss:axis2"),

    # log is strongly curved near small p: a smaller step for the central difference
    Case("MultinomialLogisticLoss", "", [PROBS, labels((6, 1, 1, 1), 5, seed=27)], check_bottom=[0], eps=1e-3,
         expected=lambda p, l: [np.array(-np.mean(np.log(p[np.arange(6), l.reshape(-1).astype(int)])))]),

    Case("SmoothL1Loss", "smooth_l1_loss_param { sigma: 3 }", list(SL1), check_bottom=[0, 1],
         expected=smooth_l1_ref(3.0), id="SmoothL1Loss:sigma3-weights"),
    Case("SmoothL1Loss", "", list(SL1_PLAIN[:2]), check_bottom=[0, 1], expected=smooth_l1_ref(),
         id="SmoothL1Loss:plain"),
    Case("SmoothL1Loss", "loss_param { normalization: NONE }", list(SL1_MAPS), check_bottom=[0, 1],
         expected=smooth_l1_ref(1.0, 1.0), id="SmoothL1Loss:maps-none"),
    Case("SmoothL1LossOHEM", "", [OHEM[0], OHEM[1], OHEM_W], n_top=2, grad=False,
         expected=smooth_l1_ohem_ref(lambda x: x.shape[0]), id="SmoothL1LossOHEM:per-roi"),
    Case("SmoothL1LossOHEM", "loss_param { normalization: PRE_FIXED pre_fixed_normalizer: 128 }",
         [OHEM[0], OHEM[1], OHEM_W], check_bottom=[0, 1],
         expected=lambda *b: smooth_l1_ohem_ref(lambda x: 128.0)(*b)[:1], id="SmoothL1LossOHEM:pre-fixed"),
    # the exact gradient with weights that are not 0 or 1 (see the layer's docstring)
    Case("SmoothL1LossOHEM", "loss_param { normalization: BATCH_SIZE }", list(OHEM[:3]), check_bottom=[0, 1],
         expected=lambda *b: smooth_l1_ohem_ref(lambda x: x.shape[0])(*b)[:1], id="SmoothL1LossOHEM:weights"),
    Case("SmoothL1LossOHEM", "", list(SL1_MAPS[:2]), n_top=2, check_bottom=[0, 1], grad=False,
         expected=smooth_l1_ohem_ref(lambda x: x.shape[0] * 6), id="SmoothL1LossOHEM:maps-valid"),
    Case("SmoothL1LossOHEM", "loss_param { normalization: NONE }", list(SL1_MAPS[:2]), check_bottom=[0, 1],
         expected=lambda *b: smooth_l1_ohem_ref(lambda x: 1.0)(*b)[:1], id="SmoothL1LossOHEM:none"),
    Case("SoftmaxWithLossOHEM", "loss_param { ignore_label: -1 }", [X45, labels((4, 1, 1, 1), 5, ignore=-1)],
         n_top=3, grad=False, expected=softmax_ohem_ref(-1), id="SoftmaxWithLossOHEM:tops"),
    Case("SoftmaxWithLossOHEM", "loss_param { ignore_label: -1 }", [X45, labels((4, 1, 1, 1), 5, ignore=-1)],
         check_bottom=[0], expected=lambda x, l: softmax_ohem_ref(-1)(x, l)[:1], id="SoftmaxWithLossOHEM:loss"),
    Case("BoxAnnotatorOHEM", "box_annotator_ohem_param { roi_per_img: 2 ignore_label: -1 }",
         [ROIS5, ROI_LOSS, labels((7, 1, 1, 1), 3, seed=44), randn(7, 12, 1, 1, seed=45)], n_top=2,
         grad=False, expected=box_annotator_ref(2, -1), id="BoxAnnotatorOHEM"),
    Case("BoxAnnotatorOHEM", "box_annotator_ohem_param { roi_per_img: 5 ignore_label: 255 }",
         [ROIS5.reshape(7, 5), ROI_LOSS.reshape(7), labels(7, 3, seed=46), randn(7, 8, seed=47)], n_top=2,
         grad=False, expected=box_annotator_ref(5, 255), id="BoxAnnotatorOHEM:flat"),

    Case("Accuracy", "", [X45, labels(4, 5, seed=28)], grad=False, expected=accuracy_ref()),
    Case("Accuracy", "accuracy_param { top_k: 2 }", [TIES, np.array([2, 0, 3, 1], np.float32)], grad=False,
         expected=accuracy_ref(2), id="Accuracy:ties-top2"),
    Case("Accuracy", "accuracy_param { top_k: 3 }", [randn(8, 6, seed=29), labels(8, 6, seed=30)],
         n_top=2, grad=False, expected=accuracy_ref(3, per_class=True), id="Accuracy:top3-per-class"),
    Case("Accuracy", "accuracy_param { ignore_label: 2 axis: -1 }", [X_SP, labels((2, 4, 3), 2, seed=31)],
         n_top=2, grad=False, expected=accuracy_ref(1, -1, 2, True), id="Accuracy:axis-ignore"),
    Case("Accuracy", "accuracy_param { ignore_label: 1 }", [X45, np.ones(4, np.float32)], n_top=2, grad=False,
         expected=accuracy_ref(1, 1, 1, True), id="Accuracy:all-ignored"),
]

test_forward, test_gradient = case_tests(CASES)


def test_scalar_top_and_default_loss_weights():
    layer, bottom, top = setup_layer("SoftmaxWithLoss", "", [X45, labels(4, 5)], n_top=2)
    assert top[0].shape == () and top[1].shape == (4, 5)
    assert layer.loss_weights(2) == [1.0, 0.0]
    assert not layer.allow_force_backward(1)
    acc, _, atop = setup_layer("Accuracy", "", [X45, labels(4, 5)], n_top=2)
    assert acc.loss_weights(2) == [0.0, 0.0] and atop[1].shape == (5,)


def test_backward_scales_by_top_diff_and_ignores_labels():
    x, lab = X_SP, labels((2, 1, 3, 2), 4, seed=2, ignore=255)
    layer, bottom, top = setup_layer("SoftmaxWithLoss", "loss_param { ignore_label: 255 }", [x, lab])
    layer.forward(bottom, top)
    top[0].diff[...] = 3.0
    bottom[0].diff[...] = 7.0   # must be overwritten, not accumulated
    layer.backward(top, [True, False], bottom)
    prob = softmax_ref(x.astype(np.float64))
    onehot = np.zeros_like(prob)
    flat = lab.reshape(2, 3, 2).astype(int)
    valid = flat != 255
    for n, h, w in zip(*np.nonzero(valid)):
        onehot[n, flat[n, h, w], h, w] = 1
    want = (prob - onehot) * valid[:, None] * 3.0 / valid.sum()
    np.testing.assert_allclose(bottom[0].diff, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("type_,params,bottoms", [
    ("SoftmaxWithLoss", "", [X45, np.array([0, 1, 7, 2], np.float32)]),
    ("SoftmaxWithLoss", "loss_param { ignore_label: -1 }", [X45, np.array([0, -1, 7, 2], np.float32)]),
    ("Accuracy", "", [X45, np.array([0, 1, 7, 2], np.float32)]),
    ("HingeLoss", "", [X45, np.array([0, 1, 7, 2], np.float32)]),
    ("MultinomialLogisticLoss", "", [X45, np.array([0, 1, 7, 2], np.float32)]),
    ("InfogainLoss", "", [X45, np.array([0, 1, 7, 2], np.float32), H5]),
])
def test_label_out_of_range_is_a_one_line_error(type_, params, bottoms):
    layer, bottom, top = setup_layer(type_, params, bottoms)
    with pytest.raises(LayerError) as info:
        layer.forward(bottom, top)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"layer 'layer' ({type_})" in msg and "got 7" in msg and "[0, 5)" in msg


def test_negative_label_is_an_error_unless_ignored():
    layer, bottom, top = setup_layer("SoftmaxWithLoss", "", [X45, np.array([0, -1, 3, 2], np.float32)])
    with pytest.raises(LayerError, match="got -1"):
        layer.forward(bottom, top)


@pytest.mark.parametrize("type_,params,bottoms,match", [
    ("SoftmaxWithLoss", "", [X45, labels(3, 5)], "same first dimension"),
    ("SoftmaxWithLoss", "", [X_SP, labels((2, 3), 4)], "number of labels must match"),
    ("EuclideanLoss", "", [randn(4, 6), randn(4, 5)], "same dimension"),
    ("SigmoidCrossEntropyLoss", "", [randn(4, 6), randn(4, 5)], "same count"),
    ("InfogainLoss", "", [X45, labels(4, 5), np.ones((4, 4), np.float32)], "infogain matrix"),
    ("ContrastiveLoss", "", [randn(4, 3, 2, 1), randn(4, 3, 2, 1), np.ones(4, np.float32)], "feature pair"),
])
def test_shape_errors(type_, params, bottoms, match):
    with pytest.raises(ShapeError, match=match):
        setup_layer(type_, params, bottoms)


def test_accuracy_top_k_above_classes_is_an_error():
    with pytest.raises(LayerError,
                       match=r"accuracy_param.top_k: must be at most the number of classes \(5\), got 6"):
        setup_layer("Accuracy", "accuracy_param { top_k: 6 }", [X45, labels(4, 5)])


# -- Intel Caffe's label smoothing (SoftmaxWithLoss) --------------------------------------------
def smoothed_gradient_ref(x, lab, smoothing, axis=1, ignore=None, mode="VALID", top_diff=1.0):
    """Intel's SoftmaxWithLoss backward with label_smoothing s, in float64 from its formula:
    dim = classes * inner, a = 1 - s, b = s / dim; per valid position the gradient is
    (a + (dim - 1) b) p - b, plus b - a at the label; 0 where ignored; times
    top_diff / normalizer."""
    rows, outer, inner = _rows(x, axis)
    classes = x.shape[axis]
    dim = classes * inner
    a, b = 1.0 - smoothing, smoothing / dim
    out, count = np.zeros_like(rows), 0
    for i, (r, l) in enumerate(zip(rows, lab.reshape(-1).astype(int))):
        if ignore is not None and l == ignore:
            continue
        out[i] = (a + (dim - 1) * b) * softmax_ref(r, 0) - b
        out[i, l] += b - a
        count += 1
    out *= top_diff / _norm(mode, outer, inner, count)
    shape = np.moveaxis(x, axis, -1).shape
    return np.moveaxis(out.reshape(shape), -1, axis)


@pytest.mark.parametrize("x,lab,params,axis,ignore,mode", [
    (X45, labels(4, 5), "", 1, None, "VALID"),
    (randn(6, 10, seed=6), labels(6, 10, seed=7, ignore=3, ignore_every=2), "loss_param { ignore_label: 3 }",
     1, 3, "VALID"),
    (X_SP, labels((2, 3, 2), 4, seed=5, ignore=1), "loss_param { ignore_label: 1 normalization: FULL }",
     1, 1, "FULL"),
    (randn(3, 4, 6, seed=8), labels((3, 4), 6, seed=9), "softmax_param { axis: 2 } "
     "loss_param { normalization: BATCH_SIZE }", 2, None, "BATCH_SIZE"),
], ids=["classes", "ignore", "spatial", "axis2"])
@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "numpy"])
def test_label_smoothing_against_intels_formula(monkeypatch, x, lab, params, axis, ignore, mode, compiled):
    """The gradient is Intel's smoothed one; the loss top stays the hard-label loss (Intel's
    forward does not read label_smoothing)."""
    from caffepy.layers import loss as loss_module
    if not compiled:
        monkeypatch.setattr(loss_module, "_kernels", None)
    smoothed = params.replace("loss_param {", "loss_param { label_smoothing: 0.2") if "loss_param" in params \
        else params + " loss_param { label_smoothing: 0.2 }"
    layer, bottom, top = setup_layer("SoftmaxWithLoss", smoothed, [x, lab])
    layer.forward(bottom, top)
    want_loss = softmax_loss_ref(axis, ignore, mode)(x.astype(np.float64), lab)[0]
    assert float(top[0].data) == pytest.approx(float(want_loss), rel=1e-5)
    top[0].diff[...] = 1.5
    layer.backward(top, [True, False], bottom)
    want = smoothed_gradient_ref(x.astype(np.float64), lab, 0.2, axis, ignore, mode, 1.5)
    np.testing.assert_allclose(bottom[0].diff, want, rtol=1e-5, atol=1e-7)
    hard = setup_layer("SoftmaxWithLoss", params, [x, lab])
    hard[0].forward(hard[1], hard[2])
    hard[2][0].diff[...] = 1.5
    hard[0].backward(hard[2], [True, False], hard[1])
    assert not np.allclose(bottom[0].diff, hard[1][0].diff, rtol=1e-3)


def _smoothed_objective_layer(params, bottoms):
    """SoftmaxWithLoss whose forward reports the objective Intel's smoothed gradient belongs
    to (one label per item): -sum (a log p_label + b sum of the other log p) / normalizer, so
    that the gradient checker differentiates it; the backward is the layer's own."""
    from caffepy.layers.loss import SoftmaxWithLoss, normalizer

    class Objective(SoftmaxWithLoss):
        def forward(self, bottom, top):
            super().forward(bottom, top)
            x = bottom[0].data.astype(np.float64)
            logp = x - x.max(axis=1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
            b = self.smoothing / self.classes
            total = 0.0
            for row, label in zip(logp, self.labels.reshape(-1)):
                if label >= 0:
                    total -= (1 - self.smoothing - b) * row[label] + b * row.sum()
            top[0].data[...] = total / normalizer(self, self.mode, self.outer, self.inner, self.count)

    layer, bottom, top = setup_layer("SoftmaxWithLoss", params, bottoms)
    mine = Objective(layer.param, layer.phase)
    mine.layer_setup(bottom, top)
    return mine, bottom, top


@pytest.mark.parametrize("params,lab", [
    ("loss_param { label_smoothing: 0.1 }", labels(4, 5)),
    ("loss_param { label_smoothing: 0.3 ignore_label: 2 normalization: BATCH_SIZE }", labels(4, 5, ignore=2)),
])
def test_label_smoothing_gradient_check(params, lab):
    from gradient_checker import check_gradient
    layer, bottom, top = _smoothed_objective_layer(params, [X45, lab])
    check_gradient(layer, bottom, top, check_bottom=[0], eps=1e-2, threshold=1e-3)


@pytest.mark.parametrize("shape", [(7, 13), (2, 5, 20, 17)])
def test_label_smoothing_zero_gives_todays_bits(monkeypatch, shape):
    """label_smoothing: 0 (and unset) runs the hard-label backward, float for float: the
    kernel's and the NumPy path's (prob - onehot) * scale as they were computed before."""
    from caffepy.layers import loss as loss_module
    x = randn(*shape, seed=62, scale=3.0)
    lab = labels(shape[:1] + shape[2:], shape[1], seed=63, ignore=255)
    for kernels in (loss_module._kernels, None):
        monkeypatch.setattr(loss_module, "_kernels", kernels)
        diffs = []
        for params in ("loss_param { ignore_label: 255 }",
                       "loss_param { ignore_label: 255 label_smoothing: 0 }"):
            layer, bottom, top = setup_layer("SoftmaxWithLoss", params, [x, lab])
            layer.forward(bottom, top)
            top[0].diff[...] = 0.7
            layer.backward(top, [True, False], bottom)
            diffs.append(bottom[0].diff.copy())
        prob, lab32 = layer.prob, layer.labels
        scale = np.float32(float(np.float32(0.7)) / loss_module.normalizer(
            layer, layer.mode, layer.outer, layer.inner, layer.count))
        weight = np.where(lab32 >= 0, scale, np.float32(0))[:, None, :]
        if kernels is not None and layer.inner > 1:     # the kernel's order there
            onehot = (lab32[:, None, :] == np.arange(prob.shape[1])[None, :, None]).astype(np.float32)
            want = (prob - onehot) * weight
        else:
            want = prob * weight
            rows, cols = np.nonzero(lab32 >= 0)
            want[rows, lab32[rows, cols], cols] -= scale
        for d in diffs:
            np.testing.assert_array_equal(d.reshape(want.shape), want)


@pytest.mark.parametrize("value", ["-0.1", "1", "1.5", "nan"])
def test_label_smoothing_outside_zero_one_is_refused(value):
    with pytest.raises(LayerError, match=r"layer 'layer' \(SoftmaxWithLoss\): loss_param.label_smoothing: "
                                         r"must be in \[0, 1\), got"):
        setup_layer("SoftmaxWithLoss", f"loss_param {{ label_smoothing: {value} }}", [X45, labels(4, 5)])


def test_label_smoothing_is_refused_by_the_other_losses():
    with pytest.raises(LayerError, match=r"\(EuclideanLoss\): loss_param.label_smoothing: applies to "
                                         r"SoftmaxWithLoss only .*got 0.1"):
        setup_layer("EuclideanLoss", "loss_param { label_smoothing: 0.1 }", [X45, randn(4, 5)])


def test_pre_fixed_normalization():
    lab = labels((2, 3, 2), 4, seed=5)
    layer, bottom, top = setup_layer(
        "SoftmaxWithLoss", "loss_param { normalization: PRE_FIXED pre_fixed_normalizer: 8 }", [X_SP, lab])
    layer.forward(bottom, top)
    want = softmax_loss_ref(1, None, "NONE")(X_SP.astype(np.float64), lab)[0] / 8
    np.testing.assert_allclose(top[0].data, want, rtol=1e-5)


def test_infogain_without_matrix_is_an_error():
    with pytest.raises(LayerError, match="infogain_loss_param.source"):
        setup_layer("InfogainLoss", "", [X45, labels(4, 5)])


def test_infogain_normalize_is_refused():
    with pytest.raises(LayerError, match="normalize"):
        setup_layer("InfogainLoss", "loss_param { normalize: true }", [X45, labels(4, 5), H5])


def test_infogain_matrix_from_binaryproto(tmp_path):
    pytest.importorskip("caffepy.prototxt")
    from caffepy.blobproto import write_blobproto
    path = tmp_path / "H.binaryproto"
    write_blobproto(H5, str(path))
    lab = labels(4, 5, seed=24)
    params = f"infogain_loss_param {{ source: '{path}' }}"
    layer, bottom, top = setup_layer("InfogainLoss", params, [X45, lab])
    layer.forward(bottom, top)
    want = infogain_ref(H5)(X45.astype(np.float64), lab)[0]
    np.testing.assert_allclose(top[0].data, want, rtol=1e-5)
    # identity H is SoftmaxWithLoss
    write_blobproto(np.eye(5, dtype=np.float32).reshape(1, 1, 5, 5), str(path))
    params = f"infogain_loss_param {{ source: '{path}' }}"
    layer, bottom, top = setup_layer("InfogainLoss", params, [X45, lab])
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, softmax_loss_ref()(X45.astype(np.float64), lab)[0], rtol=1e-5)


def test_sigmoid_ce_against_torch():
    torch = pytest.importorskip("torch")
    x, t = randn(4, 7, seed=40, scale=3.0), np.random.default_rng(41).random((4, 7)).astype(np.float32)
    layer, bottom, top = setup_layer("SigmoidCrossEntropyLoss", "", [x, t])
    layer.forward(bottom, top)
    xt = torch.tensor(x, requires_grad=True)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(xt, torch.tensor(t), reduction="sum") / 4
    loss.backward()
    np.testing.assert_allclose(top[0].data, loss.item(), rtol=1e-5)
    top[0].diff[...] = 1.0
    layer.backward(top, [True, False], bottom)
    np.testing.assert_allclose(bottom[0].diff, xt.grad.numpy(), rtol=1e-5, atol=1e-7)


NET = """
name: "tiny"
force_backward: true
layer { name: "x" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 4 dim: 5 } shape { dim: 4 } } }
layer { name: "bn" type: "BatchNorm" bottom: "x" top: "bn" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "bn" bottom: "label" top: "loss" top: "prob" }
layer { name: "acc" type: "Accuracy" bottom: "bn" bottom: "label" top: "acc" }
"""


def test_in_a_net_loss_weights_and_statistics_blobs():
    from google.protobuf import text_format
    from caffepy.net import TRAIN, Net
    from caffepy.proto import caffe_pb2
    net = Net(text_format.Parse(NET, caffe_pb2.NetParameter()), TRAIN)
    assert net.params_lr == [0.0, 0.0, 0.0]
    names = list(net.layer_dict)
    assert net.top_loss_weights[names.index("loss")] == [1.0, 0.0]
    assert net.top_loss_weights[names.index("acc")] == [0.0]
    lab = labels(4, 5, seed=50)
    out = net.forward(x=X45, label=lab)
    x = X45.astype(np.float64)
    bn = (x - x.mean(axis=0)) / np.sqrt(x.var(axis=0) + 1e-5)
    np.testing.assert_allclose(out["loss"], softmax_loss_ref()(bn, lab)[0], rtol=1e-4)
    np.testing.assert_allclose(out["acc"], accuracy_ref()(bn, lab)[0])
    np.testing.assert_allclose(out["prob"], softmax_ref(bn), rtol=1e-4, atol=1e-6)
    net.backward()
    assert np.all(net.blobs["label"].diff == 0.0)        # no gradient reaches the labels
    assert np.abs(net.blobs["x"].diff).sum() > 0


@pytest.mark.parametrize("shape,params", [
    ((7, 13), ""),
    ((2, 5, 20, 17), "loss_param { ignore_label: 255 normalization: FULL }"),   # inner 340: two blocks
    ((3, 4, 6), "softmax_param { axis: 2 } loss_param { ignore_label: 1 }"),
    ((1, 4, 300000), "loss_param { ignore_label: 255 }"),      # above the threading threshold
    ((1100, 1000), ""),
    ((1100, 1000), "loss_param { label_smoothing: 0.1 }"),
    ((2, 5, 20, 17), "loss_param { ignore_label: 255 label_smoothing: 0.2 }"),
])
def test_softmax_loss_kernel_matches_numpy_path(monkeypatch, shape, params):
    from caffepy.layers import loss as loss_module
    if loss_module._kernels is None:
        pytest.skip("caffepy.kernels.loss is not built")
    axis = 2 if "axis: 2" in params else 1
    lab_shape = shape[:axis] + shape[axis + 1:]
    x = randn(*shape, seed=60, scale=4.0)
    x.reshape(-1)[::11] = -150.0           # underflowing probabilities
    lab = labels(lab_shape, shape[axis], seed=61, ignore=255 if "255" in params else None)
    results = []
    for kernels in (loss_module._kernels, None):
        monkeypatch.setattr(loss_module, "_kernels", kernels)
        layer, bottom, top = setup_layer("SoftmaxWithLoss", params, [x, lab], n_top=2)
        layer.forward(bottom, top)
        top[0].diff[...] = 2.5
        layer.backward(top, [True, False], bottom)
        results.append((top[0].data.copy(), top[1].data.copy(), bottom[0].diff.copy()))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_kernel_exp_is_within_two_ulp():
    from caffepy.layers import loss as loss_module
    if loss_module._kernels is None:
        pytest.skip("caffepy.kernels.loss is not built")
    x = np.linspace(-87.3, 88.0, 200001).astype(np.float32)
    out = np.empty_like(x)
    loss_module._kernels.exp_array(x, out)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - want) / want) < 2 * 2.0 ** -24
    tiny = np.empty(3, np.float32)
    loss_module._kernels.exp_array(np.array([-100.0, -1e30, -np.inf], np.float32), tiny)
    np.testing.assert_allclose(tiny, np.finfo(np.float32).tiny, rtol=1e-5)   # held, not 0 or NaN


def test_softmax_loss_of_nan_scores_is_nan():
    # Caffe's loss goes NaN with its scores; a clamped finite loss would hide divergence
    from layer_cases import setup_layer
    x = np.zeros((4, 5), np.float32)
    x[1, 2] = np.nan
    layer, bottom, top = setup_layer("SoftmaxWithLoss", "", [x, np.array([0, 1, 2, 3], np.float32)])
    layer.forward(bottom, top)
    assert np.isnan(top[0].data)


@pytest.mark.parametrize("n, params", [
    (37, ""),                                                   # a tail past the 16 partial sums
    (100 * 784, ""),                                            # the MNIST autoencoder's, threaded
    (5000, "loss_param { ignore_label: 1 normalization: VALID }"),
])
def test_sigmoid_cross_entropy_kernel_matches_numpy_path(monkeypatch, n, params):
    from caffepy.layers import loss as loss_module
    if loss_module._kernels is None:
        pytest.skip("caffepy.kernels.loss is not built")
    x = randn(n, seed=70, scale=6.0)
    x[::13] = np.float32(-120.0)                                # exp(-|x|) below FLT_MIN
    x[5::13] = np.float32(95.0)
    x[7] = np.float32(0.0)
    t = np.random.default_rng(71).uniform(0, 1, n).astype(np.float32)
    t[::3] = np.round(t[::3])                                   # targets 0 and 1 among them
    results = []
    for kernels in (loss_module._kernels, None):
        monkeypatch.setattr(loss_module, "_kernels", kernels)
        layer, bottom, top = setup_layer("SigmoidCrossEntropyLoss", params, [x[None], t[None]])
        layer.forward(bottom, top)
        top[0].diff[...] = 1.5
        layer.backward(top, [True, False], bottom)
        results.append((top[0].data.copy(), bottom[0].diff.copy(), layer.norm))
    (loss, diff, norm), (ref_loss, ref_diff, ref_norm) = results
    assert norm == ref_norm
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-6)
    # sigmoid(x) - t cancels: each path is within an ulp of sigmoid, so compare absolutely
    np.testing.assert_allclose(diff, ref_diff, rtol=1e-5, atol=4e-7 * 1.5 / norm)
    if "ignore_label" in params:
        assert (diff[0][t == 1] == 0).all() and (diff[0][t != 1] != 0).any()


def test_kernel_log1p_keeps_small_arguments_exact():
    """log(1 + e) on [0, 1] within 2 ulp, relative, down to e far below float epsilon."""
    from caffepy.layers import loss as loss_module
    if loss_module._kernels is None:
        pytest.skip("caffepy.kernels.loss is not built")
    e = np.concatenate([np.linspace(0, 1, 100001), np.geomspace(1e-38, 1e-3, 2000)]).astype(np.float32)
    out = np.empty_like(e)
    loss_module._kernels.log1p_array(e, out)
    want = np.log1p(e.astype(np.float64))
    ok = want > 0
    assert np.max(np.abs(out[ok] - want[ok]) / want[ok]) < 2 * 2.0 ** -24 and out[~ok].max() == 0


def test_box_annotator_keeps_each_images_hardest_rois():
    lab = np.arange(1, 8, dtype=np.float32).reshape(7, 1, 1, 1)
    layer, bottom, top = setup_layer("BoxAnnotatorOHEM", "box_annotator_ohem_param { roi_per_img: 2 }",
                                     [ROIS5, ROI_LOSS, lab, np.ones((7, 4, 1, 1), np.float32)], n_top=2)
    layer.forward(bottom, top)
    # image 0 has ROIs 0, 2, 4, 6 (losses 0.5, 0.5, 3, 0.5): 4, then 0 of the tied three;
    # image 1 has 1, 3, 5 (2, 0.1, 2): 1 and 5
    np.testing.assert_array_equal(top[0].data.reshape(-1), [1, 2, -1, -1, 5, 6, -1])
    np.testing.assert_array_equal(top[1].data[:, :, 0, 0].sum(axis=1), [4, 4, 0, 0, 4, 4, 0])


@pytest.mark.parametrize("type_,params,bottoms,match", [
    ("SmoothL1Loss", "", [randn(2, 4), randn(2, 4), randn(2, 4)],
     r"bottom: takes the inside and outside weights together \(4 bottoms\) or neither \(2\), got 3"),
    ("SmoothL1Loss", "", [randn(2, 4), randn(2, 4), randn(2, 4), randn(2, 3)],
     r"bottom\[3\]: needs the 2 x 4 values of bottom\[0\] \(2, 4\), got \(2, 3\)"),
    ("SmoothL1Loss", "smooth_l1_loss_param { sigma: 0 }", [randn(2, 4), randn(2, 4)],
     r"smooth_l1_loss_param.sigma: must not be 0"),
    ("SmoothL1LossOHEM", "", [randn(2, 4), randn(2, 4, 1, 1), randn(3, 4)],
     r"bottom\[2\]: needs the 2 x 4 values"),
    ("BoxAnnotatorOHEM", "", [ROIS5, ROI_LOSS, ROI_LOSS, ROI_LOSS],
     r"box_annotator_ohem_param.roi_per_img: is required and must be positive, got 0"),
    ("BoxAnnotatorOHEM", "box_annotator_ohem_param { roi_per_img: 1 }", [randn(7, 4), ROI_LOSS, ROI_LOSS, ROI_LOSS],
     r"bottom\[0\]: rois must be R x 5 \(batch index, x1, y1, x2, y2\), got \(7, 4\)"),
    ("BoxAnnotatorOHEM", "box_annotator_ohem_param { roi_per_img: 1 }", [ROIS5, randn(6), ROI_LOSS, ROI_LOSS],
     r"bottom\[1\]: the per-ROI loss need one value per ROI \(7 x 1 x 1\), got \(6,\)"),
])
def test_fast_rcnn_and_ohem_input_errors(type_, params, bottoms, match):
    with pytest.raises(LayerError, match=match):
        setup_layer(type_, params, bottoms, n_top=2 if type_ == "BoxAnnotatorOHEM" else 1)
