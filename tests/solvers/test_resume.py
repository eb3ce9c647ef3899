"""Exact resume with real data: `train --snapshot` continues with the very next batch.

A run resumed from its snapshot at iteration 5 must end at iteration 12 with the
weights of the uninterrupted run, bit for bit: LMDB Data (shuffle off and on,
mirror and crop, rand_skip, prefetch 1 and 4), ImageData, Dropout drawing from
the solver's generator, iter_size 2, an unseeded run; 2 ranks under mpiexec on
a shared and a split DB.  The .solverstate keeps each rank's read positions in
an extension field Caffe skips; a state without it (Caffe's, older caffepy's)
resumes from record 0 with a line saying so.  The slow kill loop kills training
at random moments (mid-snapshot too) and resumes from the last complete snapshot
each time.
"""
import os
import random
import re
import signal
import subprocess
import sys
import time

import cv2
import numpy as np
import pytest

from caffepy import prototxt, rng, upgrade
from caffepy.blobproto import blobproto_to_array
from caffepy.data.prefetch import Prefetcher
from caffepy.errors import SolverError
from caffepy.proto import caffe_pb2
from caffepy.solvers import get_solver, snapshot
from caffepy.solvers.snapshot import RUN_STATE_FIELD, find_extension, read_solver_state
from data_helpers import make_db
from mpi_helpers import MPIEXEC, REPO

RECORDS = 23         # batches of 3 straddle the epochs
SHAPE = (3, 8, 8)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    values = [np.random.default_rng(i).integers(0, 256, SHAPE, dtype=np.uint8) for i in range(RECORDS)]
    return make_db(tmp_path_factory.mktemp("db") / "train_lmdb", RECORDS, shape=SHAPE, values=values)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    lines = []
    for i in range(11):
        cv2.imwrite(str(root / f"im{i}.png"), np.random.default_rng(i).integers(0, 256, (8, 8, 3), np.uint8))
        lines.append(f"im{i}.png {i % 4}")
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def jpeg_db(tmp_path_factory):
    from caffepy.data.datum import encoded_datum
    from caffepy.data.db import open_writer
    path = tmp_path_factory.mktemp("jpeg") / "train_lmdb"
    with open_writer(str(path)) as w:
        for i in range(RECORDS):
            img = np.random.default_rng(i).integers(0, 256, (10 + i % 3, 12, 3), dtype=np.uint8)
            w.put(f"{i:08d}", encoded_datum(cv2.imencode(".jpg", img)[1].tobytes(), i).SerializeToString())
    return str(path)


# Intel's ResNet-50 recipe (TRAIN: random aspect ratio, TEST: shorter side to 256), at crop 6
RECIPE_TRAIN = ("crop_size: 6 mirror: true mean_value: 104 mean_value: 117 mean_value: 123 scale: 0.00390625 "
                "random_aspect_ratio_param { min_area_ratio: 0.08 max_area_ratio: 1 aspect_ratio_change: 0.75 "
                "resize_param { interp_mode: CUBIC } }")
RECIPE_TEST = ("crop_size: 6 mean_value: 104 mean_value: 117 mean_value: 123 scale: 0.00390625 "
               "random_resize_param { min_size: 7 max_size: 7 resize_param { interp_mode: CUBIC } }")
# every other random augmentation
AUGMENTED = ("crop_size: 6 mirror: true scale: 0.00390625 mean_value: 110 "
             "distort_param { brightness_prob: 0.5 brightness_delta: 32 contrast_prob: 0.5 contrast_lower: 0.5 "
             "contrast_upper: 1.5 hue_prob: 0.5 hue_delta: 18 random_order_prob: 0.3 } "
             "expand_param { prob: 0.5 max_expand_ratio: 1.5 } "
             "random_resize_param { min_size: 6 max_size: 9 resize_param { interp_mode: LINEAR interp_mode: AREA } } "
             "noise_param { saltpepper: true saltpepper_param { fraction: 0.05 value: 0 } }")


def data_layer(db, data="", transform="scale: 0.00390625"):
    return (f'layer {{ name: "data" type: "Data" top: "data" top: "label"\n'
            f'  data_param {{ source: "{db}" batch_size: 3 backend: LMDB {data} }}\n'
            f'  transform_param {{ {transform} }} }}\n')


def image_layer(root, data="", transform="scale: 0.00390625"):
    return (f'layer {{ name: "data" type: "ImageData" top: "data" top: "label"\n'
            f'  image_data_param {{ source: "{root / "list.txt"}" root_folder: "{root}/" batch_size: 3 {data} }}\n'
            f'  transform_param {{ {transform} }} }}\n')


BODY = """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "drop" type: "Dropout" bottom: "conv" top: "conv" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 32 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

SOLVER = """net: "net.prototxt"
base_lr: 0.05 momentum: 0.9 weight_decay: 0.001 lr_policy: "fixed"
display: 0 max_iter: 12 snapshot: 5 snapshot_prefix: "out/run" {extra}
"""


def write_run(path, layer, extra="random_seed: 7"):
    path.mkdir()
    (path / "out").mkdir()
    (path / "net.prototxt").write_text('name: "resume"\n' + layer + BODY)
    (path / "solver.prototxt").write_text(SOLVER.format(extra=extra))
    return path


def model(path):
    net = upgrade.read_binary_net(str(path))
    return {f"{lp.name}.{i}": blobproto_to_array(bp) for lp in net.layer for i, bp in enumerate(lp.blobs)}


def identical(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def solve(path, resume=None):
    cwd = os.getcwd()
    os.chdir(path)
    try:
        solver = get_solver("solver.prototxt")
        solver.solve(resume)
        for net in [solver.net] + solver.test_nets:
            for layer in net.layers:
                if hasattr(layer, "close"):
                    layer.close()
    finally:
        os.chdir(cwd)
        rng.seed(-1)


def resume_matches(tmp_path, layer, extra="random_seed: 7"):
    """Uninterrupted to 12, then resumed from 5 to 12: the weights at 12, and whether they match."""
    full = write_run(tmp_path / "full", layer, extra)
    solve(full)
    want = model(full / "out/run_iter_12.caffemodel")
    os.remove(full / "out/run_iter_12.caffemodel")
    solve(full, "out/run_iter_5.solverstate")
    return want, model(full / "out/run_iter_12.caffemodel")


@pytest.mark.parametrize("data, transform", [
    ("", "scale: 0.00390625"),
    ("shuffle: true", "scale: 0.00390625 mirror: true crop_size: 6"),
    ("shuffle: true rand_skip: 7 prefetch: 1", "mirror: true crop_size: 5 mean_value: 120 scale: 0.00390625"),
], ids=["in_order", "shuffle_mirror_crop", "skip_prefetch_1"])
def test_resumed_lmdb_run_equals_the_uninterrupted_one(tmp_path, db, data, transform):
    want, got = resume_matches(tmp_path, data_layer(db, data, transform))
    assert identical(want, got)


def test_resumed_image_data_run_equals_the_uninterrupted_one(tmp_path, images):
    want, got = resume_matches(tmp_path, image_layer(images, "shuffle: true", "scale: 0.00390625 mirror: true crop_size: 6"))
    assert identical(want, got)


@pytest.mark.parametrize("source, transform", [("db", RECIPE_TRAIN), ("jpeg_db", RECIPE_TRAIN),
                                               ("jpeg_db", AUGMENTED)],
                         ids=["raw_recipe", "jpeg_recipe", "jpeg_augmented"])
def test_intel_augmentations_resume_exactly(tmp_path, request, source, transform):
    """Intel's augmentations draw each image's numbers from a seed the layer's generator
    gives it, so the generator state in the snapshot is all they need. A TEST net with the
    recipe's test transform runs every 4 iterations."""
    db = request.getfixturevalue(source)
    layer = data_layer(db, "shuffle: true", transform).replace("top: \"label\"\n", "top: \"label\"\n"
                                                                "  include { phase: TRAIN }\n", 1)
    layer += data_layer(db, "", RECIPE_TEST).replace("top: \"label\"\n", "top: \"label\"\n"
                                                    "  include { phase: TEST }\n", 1)
    want, got = resume_matches(tmp_path, layer, "random_seed: 7 test_iter: 2 test_interval: 4")
    assert identical(want, got)


def test_unseeded_run_with_iter_size_resumes_exactly(tmp_path, db):
    """Nothing after the snapshot depends on the seed: everything random is in the state."""
    want, got = resume_matches(tmp_path, data_layer(db, "shuffle: true", "scale: 0.00390625 mirror: true crop_size: 6"),
                               extra="iter_size: 2")
    assert identical(want, got)


def test_the_saved_position_is_what_the_solver_consumed(tmp_path, db):
    """Prefetch 4 reads ahead; the state says 5 iterations x 3 records, and the generator
    state is the one after the 5th batch's draws."""
    full = write_run(tmp_path / "full", data_layer(db, "shuffle: true", "scale: 0.00390625 mirror: true crop_size: 6"))
    solve(full)
    import json
    state = read_solver_state(full / "out/run_iter_5.solverstate")
    run = json.loads(find_extension(state.SerializeToString(), RUN_STATE_FIELD))
    (rank,) = run["ranks"]
    saved = rank["layers"]["data"]
    assert set(rank["layers"]) == {"data"}
    assert saved["reads"] == 15 and saved["records"] == RECORDS and saved["skip"] == 0
    assert saved["transform"]["bit_generator"] == "PCG64"


def test_a_state_without_positions_starts_the_data_over_and_says_so(tmp_path, db, capfd):
    from caffepy import log
    full = write_run(tmp_path / "full", data_layer(db, "shuffle: true", "scale: 0.00390625 mirror: true crop_size: 6"))
    solve(full)
    want = model(full / "out/run_iter_12.caffemodel")
    path = full / "out/run_iter_5.solverstate"
    state = read_solver_state(path)
    state.DiscardUnknownFields()          # as Caffe (or caffepy before the field) writes it
    prototxt.write_binary(state, path)
    log.set_quiet(False)
    try:
        solve(full, "out/run_iter_5.solverstate")
    finally:
        log.set_quiet(True)
    err = capfd.readouterr().err
    assert ("out/run_iter_5.solverstate has no data read positions (written by Caffe or an older caffepy): "
            "data layers data start from their first record, as in Caffe") in err
    assert not identical(want, model(full / "out/run_iter_12.caffemodel"))


def test_caffe_reads_our_solverstate_unchanged(tmp_path, db):
    """Caffe's reader keeps fields 1-6 and skips ours (1001, 1002)."""
    full = write_run(tmp_path / "full", data_layer(db))
    solve(full)
    data = (full / "out/run_iter_5.solverstate").read_bytes()
    plain = caffe_pb2.SolverState()
    plain.ParseFromString(data)
    plain.DiscardUnknownFields()
    assert plain.iter == 5 and plain.learned_net == "out/run_iter_5.caffemodel" and len(plain.history) == 4
    assert {f.number for f in caffe_pb2.SolverState.DESCRIPTOR.fields}.isdisjoint(
        {snapshot.RNG_STATE_FIELD, RUN_STATE_FIELD})


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(reads=-3), "layer 'data': reads: must be an integer in [0, 2^62), got -3"),
    (lambda d: d.pop("seed"), "layer 'data': expected the keys records, ranks, seed, skip, reads, transform"),
    (lambda d: d["transform"].update(bit_generator="MT19937"), "layer 'data': transform: not a generator state"),
])
def test_a_damaged_position_is_one_line(tmp_path, db, change, message):
    import json
    full = write_run(tmp_path / "full", data_layer(db))
    solve(full)
    path = full / "out/run_iter_5.solverstate"
    state = read_solver_state(path)
    run = json.loads(find_extension(state.SerializeToString(), RUN_STATE_FIELD))
    change(run["ranks"][0]["layers"]["data"])
    state.MergeFromString(snapshot._extension_bytes(RUN_STATE_FIELD, json.dumps(run).encode()))
    prototxt.write_binary(state, path)
    with pytest.raises(SolverError) as e:
        solve(full, "out/run_iter_5.solverstate")
    assert str(e.value).startswith("out/run_iter_5.solverstate: run state: ranks[0]: " + message)


def test_prefetcher_restart_drops_what_it_read_ahead():
    class Counter:
        def __init__(self):
            self.count = 0

        def allocate(self):
            return {"data": np.zeros(1)}

        def fill(self, buf):
            buf["data"][0] = self.count
            self.count += 1

        def close(self):
            pass

    filler = Counter()
    p = Prefetcher(filler, depth=3)
    for want in (0, 1):
        buf = p.next()
        assert buf["data"][0] == want
        p.release(buf)
    time.sleep(0.1)                        # batches 2, 3, 4 wait in the queue

    def reposition():
        filler.count = 100
    p.restart(reposition)
    got = []
    for _ in range(4):
        buf = p.next()
        got.append(int(buf["data"][0]))
        p.release(buf)
    p.close()
    assert got == [100, 101, 102, 103]


# -- 2 ranks under mpiexec ------------------------------------------------------------
def train_cli(job, ranks, *args, timeout=300):
    cmd = [sys.executable, "-m", "caffepy.cli", "train", "--solver", "solver.prototxt", *args]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=job)


@pytest.mark.mpi
@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")
@pytest.mark.parametrize("split, transform", [(False, "scale: 0.00390625 mirror: true crop_size: 6"),
                                              (True, "scale: 0.00390625 mirror: true crop_size: 6"),
                                              (False, RECIPE_TRAIN)],
                         ids=["shared_db", "split_db", "shared_db_intel_recipe"])
def test_two_ranks_resume_exactly(tmp_path, db, split, transform):
    source = db
    if split:
        from caffepy.parallel.split_db import split_db
        split_db(db, 2, str(tmp_path / "shard"))
        source = str(tmp_path / "shard_{rank}")
    job = write_run(tmp_path / "job", data_layer(source, "shuffle: true", transform))
    out = train_cli(job, 2)
    assert out.returncode == 0, out.stderr[-3000:]
    want = model(job / "out/run_iter_12.caffemodel")
    os.remove(job / "out/run_iter_12.caffemodel")
    out = train_cli(job, 2, "--snapshot", "out/run_iter_5.solverstate")
    assert out.returncode == 0, out.stderr[-3000:]
    assert identical(want, model(job / "out/run_iter_12.caffemodel"))
    # on one rank: the shared DB's record stream goes on where the two ranks had got to
    # (5 iterations x 2 ranks x 3 records), shards start over
    out = train_cli(job, 1, "--snapshot", "out/run_iter_5.solverstate")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "out/run_iter_5.solverstate was written by 2 ranks, this run has 1" in out.stderr
    if split:
        assert "layer 'data': the snapshot's 2 ranks and this run's 1 do not read one record stream" in out.stderr
    else:
        assert "layer 'data': continues the record stream where the snapshot's 2 ranks had read it together (30)" \
            in out.stderr


# -- the kill loop --------------------------------------------------------------------
KILL_NET = """
layer { name: "big" type: "InnerProduct" bottom: "data" top: "big"
  inner_product_param { num_output: 8000 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "drop" type: "Dropout" bottom: "big" top: "big" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip" type: "InnerProduct" bottom: "big" top: "ip"
  inner_product_param { num_output: 32 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

KILL_SOLVER = """net: "net.prototxt"
base_lr: 0.01 momentum: 0.9 weight_decay: 0.001 lr_policy: "step" gamma: 0.5 stepsize: 20
display: 0 max_iter: 60 snapshot: 4 snapshot_prefix: "out/run" random_seed: 5
"""
KILLS = 30


def _temporaries(out):
    return sorted(p for p in os.listdir(out) if p.endswith(".tmp"))


def _last_complete(job):
    """The newest .solverstate that reads whole and whose caffemodel is there, or None."""
    found = (re.fullmatch(r"run_iter_(\d+)\.solverstate", p) for p in os.listdir(job / "out"))
    for it in sorted((int(m[1]) for m in found if m), reverse=True):
        path = f"out/run_iter_{it}.solverstate"
        try:
            state = read_solver_state(job / path)
        except Exception:
            continue
        if os.path.exists(job / state.learned_net):
            return path, it
    return None, 0


def _fresh(job, ref):
    job.mkdir()
    (job / "out").mkdir()
    for name in ("net.prototxt", "solver.prototxt"):
        (job / name).write_text((ref / name).read_text())
    return job


def _wait_for(proc, ready, limit=120):
    deadline = time.perf_counter() + limit
    while proc.poll() is None and not ready() and time.perf_counter() < deadline:
        time.sleep(0.002)


@pytest.mark.slow
def test_kill_loop_resumes_from_the_last_complete_snapshot(tmp_path, db):
    """kill -9 at random moments of training, and every third time the moment a snapshot
    file is being written: each restart resumes from the last complete snapshot and
    removes what the killed runs left half-written; every snapshot the chain writes, the
    final one included, equals the uninterrupted run's bit for bit. A chain that reaches
    the end starts over in a new directory."""
    layer = data_layer(db, "shuffle: true", "scale: 0.00390625 mirror: true crop_size: 6")
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "out").mkdir()
    (ref / "net.prototxt").write_text('name: "kill"\n' + layer + KILL_NET)
    (ref / "solver.prototxt").write_text(KILL_SOLVER)
    out = train_cli(ref, 1)
    assert out.returncode == 0, out.stderr[-3000:]
    stamps = [line[6:21] for line in out.stderr.splitlines()
              if "Starting Optimization" in line or "Optimization Done" in line]
    seconds = np.diff([sum(float(x) * m for x, m in zip(t.split(":"), (3600, 60, 1))) for t in stamps])[0]

    chooser = random.Random(13)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    chains = [_fresh(tmp_path / "chain0", ref)]
    kills = mid_write = 0
    while kills < KILLS:
        job = chains[-1]
        resume, it = _last_complete(job)
        if it == 60:
            chains.append(_fresh(tmp_path / f"chain{len(chains)}", ref))
            continue
        stale = set(_temporaries(job / "out"))
        cmd = [sys.executable, "-m", "caffepy.cli", "train", "--solver", "solver.prototxt"]
        if resume:
            cmd += ["--snapshot", resume]
        with open(job / "log.txt", "w") as log_file:
            proc = subprocess.Popen(cmd, cwd=job, env=env, stdout=subprocess.DEVNULL, stderr=log_file)
            _wait_for(proc, lambda: "Starting Optimization" in (job / "log.txt").read_text())
            if kills % 3 == 2:
                _wait_for(proc, lambda: set(_temporaries(job / "out")) - stale)
            else:
                time.sleep(chooser.uniform(0, seconds))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        if proc.returncode == 0:
            continue
        assert proc.returncode == -signal.SIGKILL, (job / "log.txt").read_text()[-3000:]
        kills += 1
        now = set(_temporaries(job / "out"))
        mid_write += bool(now - stale)
        assert not now & stale, f"not removed at the start: {now & stale}"
        assert len(now) <= 1, now
    for job in chains:
        resume, it = _last_complete(job)
        if it < 60:
            out = train_cli(job, 1, *(["--snapshot", resume] if resume else []))
            assert out.returncode == 0, out.stderr[-3000:]
        assert _temporaries(job / "out") == []
        names = [n for n in os.listdir(job / "out") if n.endswith(".caffemodel")]
        assert "run_iter_60.caffemodel" in names
        for name in names:
            assert identical(model(ref / "out" / name), model(job / "out" / name)), (job.name, name)
    print(f"{kills} kills over {len(chains)} chains, {mid_write} of them while a snapshot file was written")
    assert mid_write >= KILLS // 3
