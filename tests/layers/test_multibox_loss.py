"""MultiBoxLoss (caffepy/layers/detection.py) against a loop reference written from the fork's
algorithm (matching, mining, encoding, the two losses, the normalizers), the gradient checker,
and matching and mining worked out by hand."""
import math

import numpy as np
import pytest

from caffepy.errors import LayerError
from caffepy.proto import caffe_pb2
from layer_cases import Case, case_tests, setup_layer

MBL = caffe_pb2.MultiBoxLossParameter
VAR = (0.1, 0.1, 0.2, 0.2)


# -- the reference: plain loops, float64 ------------------------------------------------------
def iou(a, b):
    iw, ih = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    area = lambda r: max(r[2] - r[0], 0) * max(r[3] - r[1], 0)
    return iw * ih / (area(a) + area(b) - iw * ih)


def ref_match(gt, preds, per_prediction, threshold):
    """Bipartite, then per prediction: (matched gt or -1, overlap) per prediction."""
    P = len(preds)
    o = [[iou(preds[j], g) for g in gt] for j in range(P)]
    idx, ov = [-1] * P, [max([v for v in o[j] if v > 1e-6] or [0.0]) for j in range(P)]
    pool = list(range(len(gt)))
    while pool:
        best, bj, bg = -1.0, -1, -1
        for j in range(P):
            if idx[j] != -1:
                continue
            for g in pool:
                if o[j][g] > 1e-6 and o[j][g] > best:
                    best, bj, bg = o[j][g], j, g
        if bj < 0:
            break
        idx[bj], ov[bj] = bg, best
        pool.remove(bg)
    if per_prediction:
        for j in range(P):
            if idx[j] != -1:
                continue
            best, bg = -1.0, -1
            for g in range(len(gt)):
                if o[j][g] > 1e-6 and o[j][g] >= threshold and o[j][g] > best:
                    best, bg = o[j][g], g
            if bg >= 0:
                idx[j], ov[j] = bg, best
    return idx, ov


def ref_encode(prior, var, g, code, in_target):
    v = (1, 1, 1, 1) if in_target else var
    pw, ph = prior[2] - prior[0], prior[3] - prior[1]
    if code == "CORNER":
        return [(g[k] - prior[k]) / v[k] for k in range(4)]
    pcx, pcy = (prior[0] + prior[2]) / 2, (prior[1] + prior[3]) / 2
    gcx, gcy = (g[0] + g[2]) / 2, (g[1] + g[3]) / 2
    return [(gcx - pcx) / pw / v[0], (gcy - pcy) / ph / v[1],
            math.log((g[2] - g[0]) / pw) / v[2], math.log((g[3] - g[1]) / ph) / v[3]]


def ref_softmax_loss(row, label):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return min(lse - row[label], -math.log(np.finfo(np.float32).tiny))


def ref_logistic_loss(row, label):
    return sum(max(x, 0) - x * (c == label) + math.log1p(math.exp(-abs(x))) for c, x in enumerate(row))


def ref_loc(d, smooth):
    return sum((0.5 * x * x if abs(x) < 1 else abs(x) - 0.5) if smooth else 0.5 * x * x for x in d)


def ref_multibox(loc, conf, prior, gt, s):
    """The loss, as the fork computes it, for a settings dict `s` (shared locations). Boxes and
    overlaps in float32, as the fork's: the grid makes overlaps of exactly .5 whose side of the
    thresholds depends on it."""
    loc, conf, prior, gt = (np.asarray(a, np.float32) for a in (loc, conf, prior, gt))
    N, C = conf.shape[0], s["classes"]
    P = prior.size // 8
    priors, var = prior.reshape(-1)[:4 * P].reshape(P, 4), prior.reshape(-1)[4 * P:].reshape(P, 4)
    loc, conf = loc.reshape(N, P, 4), conf.reshape(N, P, C)
    gts = {}
    for r in gt.reshape(-1, 8):
        if r[0] == -1 or (not s["use_difficult"] and r[7]):
            continue
        gts.setdefault(int(r[0]), []).append((int(r[1]), list(r[3:7])))
    smooth, softmax = s["loc"] == "SMOOTH_L1", s["conf"] == "SOFTMAX"
    conf_loss = softmax and ref_softmax_loss or ref_logistic_loss
    loc_total, conf_total, matches = 0.0, 0.0, 0
    for i in range(N):
        if i not in gts:
            if s["mining"] == "NONE":
                conf_total += sum(conf_loss(list(conf[i, j]), 0) for j in range(P))
            continue
        g = gts[i]
        idx, ov = ref_match([b for _, b in g], list(priors), s["match"] == "PER_PREDICTION", s["threshold"])
        target = [g[idx[j]][0] if idx[j] >= 0 else 0 for j in range(P)]
        enc = {j: ref_encode(priors[j], var[j], g[idx[j]][1], s["code"], s["in_target"]) for j in range(P)
               if idx[j] >= 0}
        div = {j: (var[j] if s["in_target"] else (1, 1, 1, 1)) for j in enc}
        lloss = {j: ref_loc([(loc[i, j, k] - enc[j][k]) / div[j][k] for k in range(4)], smooth) for j in enc}
        negatives = []
        if s["mining"] == "MAX_NEGATIVE":
            cand = [j for j in range(P) if idx[j] == -1 and ov[j] < s["neg_overlap"]]
            n_sel = min(int(np.float32(len(enc)) * np.float32(s["ratio"])), len(cand))
            cand.sort(key=lambda j: -conf_loss(list(conf[i, j]), target[j]))
            negatives = sorted(cand[:n_sel])
        elif s["mining"] == "HARD_EXAMPLE":
            total = {j: conf_loss(list(conf[i, j]), target[j]) + lloss.get(j, 0.0) for j in range(P)}
            chosen = set(sorted(range(P), key=lambda j: -total[j])[:min(s["sample_size"], P)])
            for j in list(enc):
                if j not in chosen:
                    del enc[j]
            negatives = sorted(j for j in chosen if idx[j] == -1)
        for j in enc:
            loc_total += lloss[j]
            conf_total += conf_loss(list(conf[i, j]), target[j])
            matches += 1
        if s["mining"] == "NONE":
            negatives = [j for j in range(P) if j not in enc]
        conf_total += sum(conf_loss(list(conf[i, j]), 0) for j in negatives)
    norm = {"VALID": matches, "FULL": N * P, "BATCH_SIZE": N, "NONE": 1}[s["norm"]]
    return (s["loc_weight"] * loc_total + conf_total) / max(1.0, norm)


# -- inputs ----------------------------------------------------------------------------------------
def grid_priors(n=4, sizes=(0.3, 0.55)):
    boxes = []
    for y in range(n):
        for x in range(n):
            cx, cy = (x + .5) / n, (y + .5) / n
            for s in sizes:
                boxes.append([cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2])
    boxes = np.float32(boxes)
    return np.concatenate([boxes.reshape(-1), np.tile(np.float32(VAR), len(boxes))]).reshape(1, 2, -1)


PRIOR = grid_priors()
P = PRIOR.size // 8
GT = np.float32([[0, 1, 0, .05, .1, .4, .45, 0], [0, 2, 0, .5, .45, .95, .9, 0],
                 [1, 1, 0, .2, .2, .8, .7, 0], [1, 3, 0, .6, .05, .75, .3, 1],
                 [-1, -1, -1, -1, -1, -1, -1, -1]]).reshape(1, 1, -1, 8)


def inputs(classes=4, seed=0, n=2):
    g = np.random.default_rng(seed)
    loc = (g.standard_normal((n, P * 4)) * 0.4).astype(np.float32)
    conf = (g.standard_normal((n, P * classes)) * 1.5).astype(np.float32)
    return [loc, conf, PRIOR, GT[:, :, : (4 if n > 1 else 2)]]


DEFAULTS = dict(classes=4, loc="SMOOTH_L1", conf="SOFTMAX", mining="MAX_NEGATIVE", match="PER_PREDICTION",
                threshold=0.5, neg_overlap=0.5, ratio=3.0, code="CENTER_SIZE", in_target=False, norm="VALID",
                loc_weight=1.0, use_difficult=True, sample_size=64)


def text(s, extra=""):
    out = (f"num_classes: {s['classes']} loc_loss_type: {s['loc']} conf_loss_type: {s['conf']} "
           f"mining_type: {s['mining']} match_type: {s['match']} overlap_threshold: {s['threshold']} "
           f"neg_overlap: {s['neg_overlap']} neg_pos_ratio: {s['ratio']} code_type: {s['code']} "
           f"encode_variance_in_target: {str(s['in_target']).lower()} loc_weight: {s['loc_weight']} "
           f"use_difficult_gt: {str(s['use_difficult']).lower()} sample_size: {s['sample_size']} {extra}")
    return f"multibox_loss_param {{ {out} }} loss_param {{ normalization: {s['norm']} }}"


def reference(s):
    def ref(loc, conf, prior, gt):
        return [np.array(ref_multibox(loc, conf, prior, gt, s))]
    return ref


VARIANTS = [
    {}, dict(loc="L2"), dict(conf="LOGISTIC"), dict(mining="NONE"), dict(mining="HARD_EXAMPLE", sample_size=12),
    dict(match="BIPARTITE"), dict(norm="FULL"), dict(norm="BATCH_SIZE"), dict(norm="NONE", mining="NONE"),
    dict(in_target=True), dict(code="CORNER"), dict(use_difficult=False, ratio=2.0), dict(loc_weight=2.5),
    dict(threshold=0.3, neg_overlap=0.3),
]
CASES = []
for v in VARIANTS:
    s = dict(DEFAULTS, **v)
    CASES.append(Case("MultiBoxLoss", text(s), inputs(), expected=reference(s), check_bottom=[0, 1],
                      eps=1e-3, threshold=3e-3, rtol=2e-5, atol=1e-5,
                      id=f"MultiBoxLoss:{','.join(f'{k}={x}' for k, x in v.items()) or 'SSD defaults'}"))

test_forward, test_gradient = case_tests(CASES)


def build(params, bottoms, phase=caffe_pb2.TRAIN):
    layer, bottom, top = setup_layer("MultiBoxLoss", params, bottoms, phase)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return layer, bottom, top


def test_ssd_defaults_match_the_reference_over_many_draws():
    s = DEFAULTS
    for seed in range(6):
        bottoms = inputs(seed=seed)
        _, _, top = build(text(s), bottoms)
        assert float(top[0].data) == pytest.approx(ref_multibox(*bottoms, s), rel=2e-5)


# -- hand-worked matching and mining -----------------------------------------------------------------
# six priors along a row; one object over prior 0 (overlap 1) that prior 1 overlaps by .6
HAND_PRIORS = np.float32([[0, 0, .4, .4], [.04, 0, .44, .4], [.5, 0, .9, .4], [0, .5, .4, .9],
                          [.5, .5, .9, .9], [.3, .3, .7, .7]])
HAND_PRIOR = np.concatenate([HAND_PRIORS.reshape(-1), np.tile(np.float32(VAR), 6)]).reshape(1, 2, -1)
HAND_GT = np.float32([[0, 1, 0, 0, 0, .4, .4, 0]]).reshape(1, 1, 1, 8)


def hand_conf(background_scores):
    """2 classes; each prior's background score given, the object's 0: background loss
    = log(1 + exp(-s))."""
    conf = np.zeros((1, 6, 2), np.float32)
    conf[0, :, 0] = background_scores
    return conf.reshape(1, 12)


def test_max_negative_mining_by_hand():
    # background losses, by prior: prior 1 hardest, then 4, then 2; but prior 1 overlaps the
    # object by .36 / .44 = .82 >= neg_overlap, so it is no candidate; 2 negatives per positive
    conf = hand_conf([0, -5, -1, 0, -3, 2])
    params = ("multibox_loss_param { num_classes: 2 match_type: BIPARTITE neg_pos_ratio: 2 } "
              "loss_param { normalization: VALID }")
    layer, _, top = build(params, [np.zeros((1, 24), np.float32), conf, HAND_PRIOR, HAND_GT])
    assert layer.matches[0][-1][0].tolist() == [0, -1, -1, -1, -1, -1]
    assert layer.negatives[0].tolist() == [2, 4]
    sp = lambda s: math.log1p(math.exp(-s))        # -log softmax of the background
    enc = np.zeros(4)        # the object is prior 0 itself: CENTER_SIZE targets 0; zero predictions
    want = sp(0 - 0) + sp(-1) + sp(-3)              # the positive (object score 0 vs background 0), 2 negatives
    want = (want + 0.5 * (enc ** 2).sum()) / 1
    assert float(top[0].data) == pytest.approx(want, rel=1e-6)
    # with neg_overlap above .82 prior 1 becomes the hardest candidate
    params2 = params.replace("neg_pos_ratio: 2", "neg_pos_ratio: 2 neg_overlap: 0.9")
    layer, _, _ = build(params2, [np.zeros((1, 24), np.float32), conf, HAND_PRIOR, HAND_GT])
    assert layer.negatives[0].tolist() == [1, 4]


def test_per_prediction_matching_makes_more_positives_and_valid_counts_them():
    conf = hand_conf([0, 0, 0, 0, 0, 0])
    params = ("multibox_loss_param { num_classes: 2 neg_pos_ratio: 1 code_type: CENTER_SIZE } "
              "loss_param { normalization: VALID }")
    layer, _, top = build(params, [np.zeros((1, 24), np.float32), conf, HAND_PRIOR, HAND_GT])
    assert layer.matches[0][-1][0].tolist() == [0, 0, -1, -1, -1, -1]       # prior 1 at .82
    # prior 1's CENTER_SIZE targets: centre .04 / .4 / .1 = 1 to the left, size 0: smooth L1 of
    # (1, 0, 0, 0) = .5 (at the kink both pieces give .5)
    assert layer.negatives[0].tolist() == [2, 3]        # ties keep the lower priors
    want = (4 * math.log(2) + 0.5) / 2
    assert float(top[0].data) == pytest.approx(want, rel=1e-6)


def test_hard_example_drops_the_positives_it_does_not_pick():
    conf = hand_conf([0, 0, -1, 0, -3, 2])
    conf = conf.reshape(1, 6, 2)
    conf[0, 0, 1] = 8                      # the positive is easy: loss ~ 3e-4
    params = ("multibox_loss_param { num_classes: 2 match_type: BIPARTITE mining_type: HARD_EXAMPLE "
              "sample_size: 2 } loss_param { normalization: NONE }")
    layer, _, top = build(params, [np.zeros((1, 24), np.float32), conf.reshape(1, 12), HAND_PRIOR, HAND_GT])
    assert layer.matches[0][-1][0].tolist() == [-1] * 6
    assert layer.negatives[0].tolist() == [2, 4]
    sp = lambda s: math.log1p(math.exp(-s))
    assert float(top[0].data) == pytest.approx(sp(-1) + sp(-3), rel=1e-6)


def test_an_image_without_objects_gives_no_mined_negatives_but_counts_without_mining():
    conf = hand_conf([0, 0, 0, 0, 0, 0])
    none = np.full((1, 1, 1, 8), -1, np.float32)
    _, _, top = build("multibox_loss_param { num_classes: 2 }", [np.zeros((1, 24), np.float32), conf,
                                                                  HAND_PRIOR, none])
    assert float(top[0].data) == 0
    _, _, top = build("multibox_loss_param { num_classes: 2 mining_type: NONE } loss_param { normalization: FULL }",
                      [np.zeros((1, 24), np.float32), conf, HAND_PRIOR, none])
    assert float(top[0].data) == pytest.approx(math.log(2), rel=1e-6)


def test_propagate_down_false_leaves_that_loss_out():
    bottoms = inputs()
    full = float(build(text(DEFAULTS), bottoms)[2][0].data)
    no_loc = float(build(text(DEFAULTS) + " propagate_down: false propagate_down: true propagate_down: false "
                                          "propagate_down: false", bottoms)[2][0].data)
    s = dict(DEFAULTS, loc_weight=0.0)
    assert no_loc == pytest.approx(ref_multibox(*bottoms, s), rel=2e-5) and no_loc < full


def test_setup_refuses_what_the_fork_refuses():
    b = inputs()
    with pytest.raises(LayerError, match=r"multibox_loss_param.num_classes: must be given"):
        setup_layer("MultiBoxLoss", "", b)
    with pytest.raises(LayerError, match=r"multibox_loss_param.mining_type: mining needs share_location: true"):
        setup_layer("MultiBoxLoss", "multibox_loss_param { num_classes: 4 share_location: false }", b)
    with pytest.raises(LayerError, match=r"background_label_id: must be a class in \[0, 4\) for SOFTMAX, got 4"):
        setup_layer("MultiBoxLoss", "multibox_loss_param { num_classes: 4 background_label_id: 4 }", b)
    with pytest.raises(LayerError, match=r"do_neg_mining: disagrees with mining_type MAX_NEGATIVE, got false"):
        setup_layer("MultiBoxLoss", "multibox_loss_param { num_classes: 4 do_neg_mining: false }", b)
    with pytest.raises(LayerError, match=r"bottom\[1\]: conf needs 128 values per image \(32 priors\)"):
        setup_layer("MultiBoxLoss", "multibox_loss_param { num_classes: 4 }", [b[0], b[1][:, :-4], b[2], b[3]])
    bad = GT.copy()
    bad[0, 0, 1, 1] = 0
    with pytest.raises(LayerError, match=r"bottom\[3\]: a ground truth box has the background label, got 0"):
        build("multibox_loss_param { num_classes: 4 }", [b[0], b[1], b[2], bad])


def test_per_class_locations_and_decoded_matching_reduce_to_the_shared_case():
    base = dict(DEFAULTS, mining="NONE")
    loc, conf, prior, gt = inputs()
    want = float(build(text(base), [loc, conf, prior, gt])[2][0].data)
    # every class slot holds the shared prediction: the positives' slots give the same loss
    per_class = np.repeat(loc.reshape(2, P, 1, 4), 4, axis=2).reshape(2, -1)
    layer, bottom, top = build(text(base, "share_location: false"),
                               [per_class, conf, prior, gt])
    assert float(top[0].data) == pytest.approx(want, rel=1e-6)
    top[0].diff[...] = 1
    layer.backward(top, [True, False, False, False], bottom)
    diff = bottom[0].diff.reshape(2, P, 4, 4)
    labels = {0: {1, 2}, 1: {1, 3}}
    for i in range(2):
        for c in range(4):
            assert (np.abs(diff[i, :, c]).sum() > 0) == (c in labels[i])     # only the objects' classes
    # zero predictions decode to the priors themselves: matching them is matching the priors
    zero = np.zeros_like(loc)
    a = float(build(text(DEFAULTS), [zero, conf, prior, gt])[2][0].data)
    b = float(build(text(DEFAULTS, "use_prior_for_matching: false"),
                    [zero, conf, prior, gt])[2][0].data)
    assert a == pytest.approx(b, rel=1e-6)


def test_bp_inside_holds_coordinates_outside_the_image_at_zero_gradient():
    loc, conf, prior, gt = inputs()
    layer, bottom, top = build(text(DEFAULTS, "bp_inside: true"), [loc, conf, prior, gt])
    top[0].diff[...] = 1
    layer.backward(top, [True, False, False, False], bottom)
    priors = prior.reshape(-1)[:4 * P].reshape(P, 4)
    outside = (priors < 0) | (priors > 1)
    diff = bottom[0].diff.reshape(2, P, 4)
    checked = 0
    for i in range(2):
        matched = layer.matches[i][-1][0] > -1
        assert (diff[i][~matched] == 0).all()
        assert (diff[i][matched & outside.any(axis=1)][outside[matched & outside.any(axis=1)]] == 0).all()
        assert (diff[i][matched][~outside[matched]] != 0).all()
        checked += (matched & outside.any(axis=1)).sum()
    assert checked > 0
