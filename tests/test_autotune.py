"""Per-layer algorithm choice by measurement (caffepy/autotune.py): the fastest candidate is
kept, stored per machine and key, read back instead of measuring, a damaged cache is set aside,
CAFFEPY_AUTOTUNE=0 leaves the choice to the rule; a channels-last Convolution measures its
candidates on its first reshape of a shape and says so."""
import json
import time

import numpy as np
import pytest

from caffepy import autotune
from caffepy.context import SINGLE
from caffepy.layer import NHWC
from layer_cases import randn, setup_layer


class _Layer:
    context = SINGLE
    tuning = None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAFFEPY_AUTOTUNE", "1")
    monkeypatch.setenv("CAFFEPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_cache", None)
    return tmp_path / "autotune.json"


def _candidates(calls):
    def slow():
        calls.append("slow")
        time.sleep(0.01)

    def fast():
        calls.append("fast")
    return {"slow": slow, "fast": fast}


def test_the_fastest_is_kept_stored_and_read_back(cache):
    calls, layer = [], _Layer()
    assert autotune.choose(layer, "k1", _candidates(calls), "slow", 2) == "fast"
    assert layer.tuning.startswith("measured ") and "slow" in calls and "fast" in calls
    stored = json.loads(cache.read_text())
    machine = autotune.machine_key(2)
    assert stored[machine]["k1"]["choice"] == "fast" and set(stored[machine]["k1"]["ms"]) == {"slow", "fast"}
    autotune._cache = None                  # a new process: reads the file, measures nothing
    calls.clear()
    assert autotune.choose(layer, "k1", _candidates(calls), "slow", 2) == "fast"
    assert layer.tuning == "cached" and calls == []
    # another thread count is another machine: measured again
    assert autotune.choose(layer, "k1", _candidates(calls), "slow", 1) == "fast" and calls


def test_a_new_candidate_is_measured_not_hidden_by_the_cache(cache):
    """An entry stored before an algorithm existed does not keep the old choice for good."""
    calls, layer = [], _Layer()
    only_slow = {"slow": _candidates(calls)["slow"]}
    only_slow["slower"] = lambda: time.sleep(0.02)
    assert autotune.choose(layer, "k2", only_slow, "slow", 2) == "slow"
    autotune._cache = None
    calls.clear()
    assert autotune.choose(layer, "k2", _candidates(calls), "slow", 2) == "fast"
    assert layer.tuning.startswith("measured ") and "fast" in calls


def test_off_means_the_rule(cache, monkeypatch):
    monkeypatch.setenv("CAFFEPY_AUTOTUNE", "0")
    calls, layer = [], _Layer()
    assert autotune.choose(layer, "k", _candidates(calls), "slow", 2) == "slow"
    assert layer.tuning == "rule" and calls == [] and not cache.exists()


def test_a_damaged_cache_is_set_aside(cache):
    cache.write_text("{not json")
    layer = _Layer()
    assert autotune.choose(layer, "k", _candidates([]), "slow", 2) == "fast"
    assert (cache.parent / "autotune.json.bad").read_text() == "{not json"
    assert json.loads(cache.read_text())[autotune.machine_key(2)]["k"]["choice"] == "fast"


def test_a_convolution_measures_its_candidates_once_per_shape(cache):
    """Each pass (forward, weight gradient, data gradient) is measured and chosen on its own."""
    params = "convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' } }"
    layer, bottom, top = setup_layer("Convolution", params, [randn(1, 16, 8, 8)], layout=NHWC)
    parts = layer.tuning.split("; ")
    assert [p.split(" ")[:2] for p in parts] == [["forward", "measured"], ["weights", "measured"],
                                                ["data", "measured"]]
    assert set(layer.algos) == {"forward", "weights", "data"}
    assert all(a.name in layer.algorithms for a in layer.algos.values())
    assert set(layer.algorithms) == {"im2col+gemm", "direct", "winograd F(2,3)", "winograd F(3,3)",
                                     "winograd F(4,3)", "winograd F(5,3)"}
    stored = json.loads(cache.read_text())[autotune.machine_key(autotune_threads())]
    passes = {k.rsplit(" ", 1)[1]: v for k, v in stored.items() if " backward " not in k}
    assert set(passes) == {"forward", "weights", "data"}
    # direct: a weight gradient of its own, the GEMM's data gradient
    assert "direct" in passes["weights"]["ms"] and "direct" not in passes["data"]["ms"]
    # the gradients chosen apart are measured once more together (_one_backward)
    apart = passes["weights"]["choice"] != passes["data"]["choice"]
    assert apart == any(" backward " in k for k in stored)
    before = [b.diff.copy() for b in layer.blobs]
    layer.reshape(bottom, top)              # same shape: no new measurement
    assert layer.tuning.startswith("forward measured ")
    for b, d in zip(layer.blobs, before):   # the trials leave the parameter gradients alone
        np.testing.assert_array_equal(b.diff, d)
    autotune._cache = None
    again, _, _ = setup_layer("Convolution", params, [randn(1, 16, 8, 8)], layout=NHWC)
    assert again.tuning == "cached" and again.algorithm == layer.algorithm


def autotune_threads():
    from caffepy.kernels import nhwc
    return nhwc.max_threads()


@pytest.mark.parametrize("backward, together", [("winograd F(4,3)", True), ("apart", False)])
def test_gradients_chosen_apart_run_together_when_that_is_faster(monkeypatch, backward, together):
    """Weights by F(5,3) and data by F(4,3), each the fastest alone: then the two gradients are
    timed together, apart and each by one algorithm, and the fastest of those runs."""
    picks = {"forward": "winograd F(4,3)", "weights": "winograd F(5,3)", "data": "winograd F(4,3)"}
    asked = []

    def choose(layer, key, candidates, default, threads, kin=()):
        asked.append(key)
        layer.tuning = "fake"
        if " backward " in key:
            assert set(candidates) == {"apart", "winograd F(5,3)", "winograd F(4,3)"}
            held = [b.diff.copy() for b in layer.blobs]
            for run in candidates.values():     # each trial runs and leaves the diffs alone
                run()
            for b, kept in zip(layer.blobs, held):
                np.testing.assert_array_equal(b.diff, kept)
            return backward
        return picks[key.rsplit(" ", 1)[1]]
    monkeypatch.setattr(autotune, "choose", choose)
    params = "convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' } }"
    layer, _, _ = setup_layer("Convolution", params, [randn(1, 16, 8, 8)], layout=NHWC)
    assert asked[-1].endswith("backward winograd F(5,3) + winograd F(4,3)")
    weights, data = layer.algos["weights"], layer.algos["data"]
    assert (weights is data) == together
    assert data.name == "winograd F(4,3)"
    assert weights.name == ("winograd F(4,3)" if together else "winograd F(5,3)")


def _ip(rows, outputs, inputs, phase=None):
    from caffepy.net import TRAIN
    params = f"inner_product_param {{ num_output: {outputs} weight_filler {{ type: 'gaussian' }} }}"
    return setup_layer("InnerProduct", params, [randn(rows, inputs)], phase=phase or TRAIN)


def test_an_inner_product_measures_skinny_against_the_blas_per_pass(cache):
    """Forward and data gradient each time skinny_gemm and the BLAS (TEST: the forward only);
    the products give the same numbers whichever runs."""
    from caffepy.net import TEST
    layer, bottom, top = _ip(16, 96, 80)
    stored = json.loads(cache.read_text())[autotune.machine_key(autotune_threads())]
    for name in ("forward", "data"):
        assert set(stored[f"InnerProduct 16x80 -> 96 {name}"]["ms"]) == {"skinny", "gemm"}
    assert "measured skinny " in layer.tuning      # the two passes' timings (one text if alike)
    x, w, b = bottom[0].data, layer.blobs[0].data, layer.blobs[1].data
    top[0].diff[...] = randn(16, 96, seed=5)
    for forward_skinny in (True, False):
        layer._skinny = {"forward": forward_skinny, "data": not forward_skinny}
        layer.forward(bottom, top)
        np.testing.assert_allclose(top[0].data, x @ w.T + b, rtol=1e-5, atol=1e-5)
        layer.backward(top, [True], bottom)
        np.testing.assert_allclose(bottom[0].diff, top[0].diff @ w, rtol=1e-5, atol=1e-5)
    test_layer, _, _ = _ip(16, 96, 72, phase=TEST)
    assert test_layer.tuning.startswith("measured ") and not any(
        k.startswith("InnerProduct 16x72 -> 96 data") for k in json.loads(cache.read_text())[
            autotune.machine_key(autotune_threads())])


def test_an_inner_product_rule_runs_skinny_up_to_four_vectors_of_items(cache, monkeypatch):
    from caffepy.kernels import common
    monkeypatch.setenv("CAFFEPY_AUTOTUNE", "0")
    most = 4 * common.SKINNY_WIDTH
    assert (_ip(most, 8 * most, 8 * most)[0].algorithm, _ip(most + 8, 8 * most, 8 * most)[0].algorithm) \
        == ("skinny", "gemm")
    assert _ip(7, 64, 64)[0].algorithm == "gemm"          # below 8 items: mostly padding
    assert _ip(16, 32, 640)[0].tuning == "only"          # 4 x 16 > 32 outputs: the BLAS alone
    assert not cache.exists()


def test_a_clear_loser_is_measured_once(monkeypatch):
    """After an uncounted warm-up, the first round's leader keeps the others within PRUNE[0] of
    it, each later round's within PRUNE[1]: a candidate 25 times slower runs twice, one 1.5
    times slower three times, the leader and one as fast every round (on a clock the
    candidates advance by their cost)."""
    now, calls = [0.0], []
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: now[0])

    def runner(name, seconds):
        def run():
            calls.append(name)
            now[0] += seconds
        return run

    costs = {"slow": 0.25, "fast": 0.01, "same": 0.01, "half": 0.015}
    best = autotune.measure({name: runner(name, t) for name, t in costs.items()}, rounds=3)
    assert best == pytest.approx(costs)
    assert [calls.count(name) for name in costs] == [2, 4, 4, 3]


def test_a_first_run_s_one_time_work_does_not_decide(monkeypatch):
    """A candidate whose first run pays one-time work (a GEMM packing its weights) 20 times
    its steady cost still wins when it is the faster: the warm-up is not counted or pruned."""
    now = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: now[0])

    def runner(costs):
        def run():
            now[0] += costs.pop(0) if len(costs) > 1 else costs[0]
        return run

    best = autotune.measure({"direct": runner([0.02, 0.006]), "gemm": runner([0.1, 0.002])})
    assert best == pytest.approx({"direct": 0.006, "gemm": 0.002})


def test_a_margin_keeps_the_default_unless_another_is_that_much_faster(cache, monkeypatch):
    """With a margin the default is measured every round (a slow run cannot drop it: its best
    run counts) and another candidate wins only beyond the margin."""
    now, calls = [0.0], []
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: now[0])

    def runner(name, costs):
        def run():
            calls.append(name)
            now[0] += costs.pop(0) if len(costs) > 1 else costs[0]
        return run

    layer = _Layer()
    # the default's first run 3x the other's (a busy moment), then 1.2x: within a margin of 1.25
    runs = {"default": runner("default", [0.03, 0.012]), "other": runner("other", [0.01])}
    assert autotune.choose(layer, "m1", runs, "default", 2, margin=1.25) == "default"
    assert calls.count("default") == 4
    runs = {"default": runner("default", [0.013]), "other": runner("other", [0.01])}
    assert autotune.choose(layer, "m2", runs, "default", 2, margin=1.25) == "other"      # 1.3x
    runs = {"default": runner("default", [0.03, 0.012]), "other": runner("other", [0.01])}
    assert autotune.choose(layer, "m3", runs, "default", 2) == "other"      # no margin: the faster


@pytest.mark.parametrize("n,cls", [(1, "1"), (2, "2-3"), (3, "2-3"), (16, "16-31"), (31, "16-31"),
                                   (32, "32-63")])
def test_batch_sizes_share_measurements_by_power_of_two_ranges(n, cls):
    assert autotune.batch_class(n) == cls


def test_a_new_batch_size_in_a_measured_range_measures_nothing(cache):
    """A convolution measured at batch 4 takes that choice at batch 6 (the first forward of a
    new batch size costs no measuring), and measures again at batch 1."""
    params = "convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: 'xavier' } }"
    tunings = []
    for n in (4, 6, 1):
        layer, _, _ = setup_layer("Convolution", params, [randn(n, 16, 10, 10)], layout=NHWC)
        tunings.append(layer.tuning)
    assert "measured" in tunings[0] and "measured" not in tunings[1] and "cached" in tunings[1]
    assert "measured" in tunings[2]


def test_a_measurement_on_a_busy_machine_is_not_stored(cache, monkeypatch):
    """Candidates measured with fewer threads than the section's count (other processes held
    cores) decide for this process only; the next process measures again."""
    calls, layer = [], _Layer()
    monkeypatch.setattr(autotune, "free_threads", lambda: 1)
    assert autotune.choose(layer, "k1", _candidates(calls), "slow", 2) == "fast"
    assert layer.tuning.endswith("(other processes busy: not stored)")
    assert not cache.exists() or "k1" not in cache.read_text()
    calls.clear()
    assert autotune.choose(layer, "k1", _candidates(calls), "slow", 2) == "fast"
    assert layer.tuning == "cached" and calls == []          # this process keeps it
    autotune._cache = None                                   # a new process, the machine free
    monkeypatch.setattr(autotune, "free_threads", lambda: 2)
    assert autotune.choose(layer, "k1", _candidates(calls), "slow", 2) == "fast" and calls
    assert "k1" in cache.read_text()


def test_a_new_batch_range_leaves_out_what_lost_clearly_at_a_measured_one(cache):
    """kin: the same choice's keys at other batch ranges. Where one was measured, a candidate
    it found KIN_WITHIN times slower than its fastest is not run at the new range; the entry
    names it as skipped, and reads back as cached. The kept default (a margin) always runs."""
    calls, layer = [], _Layer()
    assert autotune.choose(layer, "conv 16-31", _candidates(calls), "slow", 2) == "fast"
    calls.clear()
    assert autotune.choose(layer, "conv 4-7", _candidates(calls), "slow", 2,
                           kin=["conv 8-15", "conv 16-31"]) == "fast"
    assert "slow" not in calls and "fast" in calls
    assert "not slow: slow at another batch range" in layer.tuning
    stored = json.loads(cache.read_text())[autotune.machine_key(2)]["conv 4-7"]
    assert stored["skipped"] == ["slow"] and set(stored["ms"]) == {"fast"}
    autotune._cache = None
    calls.clear()
    assert autotune.choose(layer, "conv 4-7", _candidates(calls), "slow", 2) == "fast"
    assert layer.tuning == "cached" and calls == []
    # a default kept by a margin is measured whatever its kin found
    calls.clear()
    autotune.choose(layer, "conv 2-3", _candidates(calls), "slow", 2, margin=1.2,
                    kin=["conv 4-7", "conv 16-31"])
    assert "slow" in calls
    # with no kin measured (only ranges never seen), everything runs
    calls.clear()
    autotune.choose(layer, "conv 64-127", _candidates(calls), "slow", 2, kin=["conv 128-255"])
    assert "slow" in calls


def test_kin_keys_are_the_nearest_ranges_of_several_images():
    assert autotune.kin_keys(1, str) == []
    assert autotune.kin_keys(8, str)[:4] == ["16-31", "4-7", "32-63", "2-3"]
    assert "1" not in autotune.kin_keys(2, str) and autotune.kin_keys(2, str)[0] == "4-7"
