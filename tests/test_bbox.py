"""SSD's box arithmetic (caffepy/bbox.py) on cases worked out by hand."""
import numpy as np
import pytest

from caffepy import bbox
from caffepy.proto import caffe_pb2

CT = caffe_pb2.PriorBoxParameter
MT = caffe_pb2.MultiBoxLossParameter


def test_jaccard_normalized_and_pixel_boxes():
    assert bbox.jaccard([0, 0, .5, .5], [.25, .25, .75, .75])[0, 0] == pytest.approx(.0625 / .4375)
    # pixel boxes count both end pixels: 10 x 10 boxes sharing 5 x 5
    assert bbox.jaccard([0, 0, 9, 9], [5, 5, 14, 14], normalized=False)[0, 0] == pytest.approx(25 / 175)
    # touching: nothing shared when normalized, one column of pixels otherwise
    assert bbox.jaccard([0, 0, .5, .5], [.5, 0, 1, .5])[0, 0] == 0
    assert bbox.jaccard([0, 0, 4, 4], [4, 0, 8, 4], normalized=False)[0, 0] == pytest.approx(5 / 45)
    # an inverted box has no area and overlaps nothing
    assert bbox.area([.5, .5, .4, .9]) == 0 and bbox.jaccard([.5, .5, .4, .9], [0, 0, 1, 1])[0, 0] == 0
    assert bbox.jaccard(np.zeros((3, 4)), np.zeros((2, 4))).shape == (3, 2)


def test_coverage_project_locate_mirror():
    assert bbox.coverage([0, 0, .5, .5], [0, 0, 1, 1])[0, 0] == 1
    assert bbox.coverage([0, 0, 1, 1], [0, 0, .5, .5])[0, 0] == .25
    crop = [.25, .25, .75, .75]
    boxes = [[.5, .5, 1, 1], [0, 0, .2, .2], [.75, .3, .9, .4], [.3, .3, .4, .4]]
    out, kept = bbox.project(boxes, crop)
    assert kept.tolist() == [True, False, False, True]     # the third only touches the crop's edge
    np.testing.assert_allclose(out[0], [.5, .5, 1, 1])     # clipped to the crop
    np.testing.assert_allclose(out[3], [.1, .1, .3, .3], rtol=1e-6)
    np.testing.assert_allclose(bbox.locate(crop, out[3]), boxes[3], rtol=1e-6)
    np.testing.assert_allclose(bbox.mirror([[.1, .2, .3, .4]]), [[.7, .2, .9, .4]], rtol=1e-6)


@pytest.mark.parametrize("code", [CT.CORNER, CT.CENTER_SIZE, CT.CORNER_SIZE])
@pytest.mark.parametrize("in_target", [False, True])
def test_encode_then_decode_gives_the_box_back(code, in_target):
    gen = np.random.default_rng(0)
    lo = gen.uniform(0, .5, (20, 2))
    priors = np.concatenate([lo, lo + gen.uniform(.1, .5, (20, 2))], axis=1).astype(np.float32)
    lo = gen.uniform(0, .5, (20, 2))
    gt = np.concatenate([lo, lo + gen.uniform(.1, .5, (20, 2))], axis=1).astype(np.float32)
    var = np.tile(np.float32([.1, .1, .2, .2]), (20, 1))
    loc = bbox.encode(priors, var, gt, code, in_target)
    np.testing.assert_allclose(bbox.decode(priors, var, loc, code, in_target), gt, atol=1e-5)
    if code == CT.CENTER_SIZE and not in_target:      # SSD's usual coding, spelled out
        pw = priors[0, 2] - priors[0, 0]
        want = ((gt[0, 0] + gt[0, 2]) / 2 - (priors[0, 0] + priors[0, 2]) / 2) / pw / .1
        assert loc[0, 0] == pytest.approx(want, rel=1e-5)
        assert loc[0, 2] == pytest.approx(np.log((gt[0, 2] - gt[0, 0]) / pw) / .2, rel=1e-5)


PRIORS = np.float32([[0, 0, .5, .5], [.5, 0, 1, .5], [0, .5, .5, 1], [.5, .5, 1, 1], [.25, .25, .75, .75]])
GT = np.float32([[0, 0, .4, .5], [.3, .3, .8, .8]])
# overlaps, by hand: gt0-prior0 .2/.25 = .8, gt0-prior4 .0375/.4125; gt1-prior4 .2025/.2975,
# gt1-prior3 .09/.41, gt1-prior0 .04/.46, gt1-prior1 and prior2 .06/.44; gt0 only touches prior2


def test_bipartite_then_per_prediction_matching():
    idx, ov = bbox.match(GT, PRIORS, MT.BIPARTITE, .5)
    assert idx.tolist() == [0, -1, -1, -1, 1]
    np.testing.assert_allclose(ov, [.8, .06 / .44, .06 / .44, .09 / .41, .2025 / .2975], rtol=1e-5)
    idx, _ = bbox.match(GT, PRIORS, MT.PER_PREDICTION, .5)
    assert idx.tolist() == [0, -1, -1, -1, 1]         # nothing else reaches .5
    idx, ov = bbox.match(GT, PRIORS, MT.PER_PREDICTION, .2)
    assert idx.tolist() == [0, -1, -1, 1, 1]          # prior 3 takes gt1 at .2195
    assert ov[3] == pytest.approx(.09 / .41, rel=1e-5)


def test_bipartite_gives_every_gt_its_best_prior_even_below_the_threshold():
    # gt1's best prior overlaps it by .2: bipartite matching still pairs them; gt0 and gt1
    # both prefer prior 0, gt0 more, so gt1 falls back to its next best
    priors = np.float32([[0, 0, .5, .5], [.4, .4, .9, .9]])
    gt = np.float32([[0, 0, .5, .5], [.1, .1, .6, .6]])
    idx, ov = bbox.match(gt, priors, MT.PER_PREDICTION, .5)
    assert idx.tolist() == [0, 1]
    assert ov[1] == pytest.approx(bbox.jaccard(priors[1], gt[1])[0, 0]) and ov[1] < .5


def test_matching_ties_and_boundary():
    # two identical priors: the lower index wins the bipartite pairing, the other matches per prediction
    priors = np.float32([[.1, .1, .5, .5], [.1, .1, .5, .5], [-.05, .1, .4, .5]])  # overlap .12 / .22
    gt = np.float32([[.1, .1, .5, .5]])
    assert bbox.match(gt, priors, MT.BIPARTITE, .5)[0].tolist() == [0, -1, -1]
    assert bbox.match(gt, priors, MT.PER_PREDICTION, .5)[0].tolist() == [0, 0, 0]
    idx, ov = bbox.match(gt, priors, MT.PER_PREDICTION, .5, ignore_cross_boundary=True)
    assert idx.tolist() == [0, 0, -2] and ov[2] == 0
    assert bbox.match(np.zeros((0, 4), np.float32), priors, MT.BIPARTITE, .5)[0].tolist() == [-1, -1, -1]


def test_nms_by_loss_skips_tiny_boxes_and_stops_at_top_k():
    boxes = np.float32([[0, 0, .5, .5], [0, 0, .5, .49], [.6, .6, .9, .9], [.1, .1, .1001, .1001],
                        [.5, .5, 1, 1]])
    scores = [1, .9, .8, 5, .7]
    assert bbox.nms_by_loss(boxes, scores, .5, -1) == [0, 2, 4]
    assert bbox.nms_by_loss(boxes, scores, .5, 2) == [0]          # top_k cuts the candidates first
    assert bbox.nms_by_loss(boxes, scores, .99, -1) == [0, 1, 2, 4]


@pytest.mark.parametrize("scores, tp, num_pos, want", [
    # precision 1, .5, .667, .5 at recall .333, .333, .667, .667
    ([.9, .8, .7, .6], [1, 0, 1, 0], 3, {"11point": 6 / 11, "MaxIntegral": 5 / 9, "Integral": 5 / 9}),
    # precision 0, .5, .667 at recall 0, .5, 1
    ([.9, .8, .7], [0, 1, 1], 2, {"11point": 2 / 3, "MaxIntegral": 2 / 3, "Integral": .5 * .5 + .5 * 2 / 3}),
    ([.3, .9], [1, 0], 1, {"11point": .5, "MaxIntegral": .5, "Integral": .5}),       # ranked by score
    ([], [], 4, {"11point": 0, "MaxIntegral": 0, "Integral": 0}),
    ([.5], [0], 0, {"11point": 0, "MaxIntegral": 0, "Integral": 0}),
])
def test_average_precision_by_hand(scores, tp, num_pos, want):
    for version, value in want.items():
        assert bbox.average_precision(scores, tp, num_pos, version) == pytest.approx(value, abs=1e-6), version
