"""Shared by the test_mpi_* modules: a small LMDB, small nets and solvers, and
running `caffepy train` on 1 rank (plain) or N ranks (mpiexec from the venv)."""
import os
import subprocess
import sys

import numpy as np

from paths import REPO
BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec")
RECORDS = 96
CLASSES = 4


def make_lmdb(path, n=RECORDS, seed=0, shape=(2, 4, 4)):
    """Float Datums whose label is predictable from the pixels; the value of record i
    also encodes i in channel 0, pixel 0 (for the once-per-epoch checks)."""
    from caffepy.data.datum import array_to_datum
    from caffepy.data.db import open_writer
    r = np.random.default_rng(seed)
    with open_writer(str(path)) as w:
        for i in range(n):
            label = i % CLASSES
            x = r.normal(0, 1, shape).astype(np.float32) + 0.5 * label
            x[0, 0, 0] = i
            w.put(f"{i:08d}", array_to_datum(x, label).SerializeToString())
    return str(path)


def conv_net(source, batch, hybrid=False, fc=None, bn=False):
    """Data -> conv (as a fully connected layer over 2x4x4) -> ReLU -> classifier -> loss.

    fc: "InnerProduct" uses InnerProduct layers (needed for model parallel);
    hybrid marks them `multinode { model_parts: 0 }`; bn puts a BatchNorm with global
    statistics (so ranks and one rank agree) and a learned Scale, both in place, before the ReLU:
    a fused pair on the fast path."""
    mn = "multinode { model_parts: 0 }" if hybrid else ""
    if fc == "InnerProduct":
        hidden = f"""layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param {{ num_output: 8 weight_filler {{ type: "gaussian" std: 0.3 }}
            bias_filler {{ type: "constant" value: 0.1 }} }} {mn} }}"""
        out = f"""layer {{ name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
          inner_product_param {{ num_output: {CLASSES} weight_filler {{ type: "gaussian" std: 0.3 }}
            bias_filler {{ type: "constant" value: 0.0 }} }} {mn} }}"""
    else:
        hidden = """layer { name: "fc1" type: "Convolution" bottom: "data" top: "fc1"
          convolution_param { num_output: 8 kernel_size: 4 weight_filler { type: "gaussian" std: 0.3 }
            bias_filler { type: "constant" value: 0.1 } } }"""
        out = f"""layer {{ name: "fc2" type: "Convolution" bottom: "fc1" top: "fc2"
          convolution_param {{ num_output: {CLASSES} kernel_size: 1 weight_filler {{ type: "gaussian" std: 0.3 }} }} }}"""
    return f"""name: "tiny"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}
{hidden}
{BN_SCALE if bn else ""}
layer {{ name: "relu1" type: "ReLU" bottom: "fc1" top: "fc1" }}
{out}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }}
"""


# zero statistics: the BatchNorm multiplies by 1/sqrt(eps), the Scale starts by undoing it
# (and learns slowly: its gradient carries that factor)
BN_SCALE = """layer { name: "bn1" type: "BatchNorm" bottom: "fc1" top: "fc1"
  batch_norm_param { use_global_stats: true } }
layer { name: "scale1" type: "Scale" bottom: "fc1" top: "fc1"
  param { lr_mult: 0.0003 } param { lr_mult: 1 }
  scale_param { bias_term: true filler { type: "constant" value: 0.003 }
    bias_filler { type: "constant" value: 0.1 } } }"""


def solver_text(net_path, prefix, max_iter=6, extra=""):
    return f"""net: "{net_path}"
base_lr: 0.1
momentum: 0.9
weight_decay: 0.001
lr_policy: "fixed"
display: 1
max_iter: {max_iter}
snapshot_prefix: "{prefix}"
random_seed: 7
{extra}
"""


def write_job(tmp_path, name, source, batch, max_iter=6, extra="", **net_kw):
    d = tmp_path / name
    d.mkdir()
    (d / "net.prototxt").write_text(conv_net(source, batch, **net_kw))
    (d / "solver.prototxt").write_text(solver_text(d / "net.prototxt", d / "snap", max_iter, extra))
    return d


def train(job, ranks=1, args=(), timeout=240, env=None):
    cmd = [sys.executable, "-m", "caffepy.cli", "train", "--solver", str(job / "solver.prototxt"), *args]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    full_env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=job)


def weights(path):
    from caffepy import upgrade
    from caffepy.blobproto import blobproto_to_array
    net = upgrade.read_binary_net(str(path))
    return {f"{lp.name}.{i}": blobproto_to_array(bp) for lp in net.layer for i, bp in enumerate(lp.blobs)}


def max_rel_diff(a, b):
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        assert a[k].shape == b[k].shape, k
        scale = max(np.abs(a[k]).max(), 1e-12)
        worst = max(worst, float(np.abs(a[k] - b[k]).max() / scale))
    return worst
