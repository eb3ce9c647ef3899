"""Fixtures and cases of the bad-input corpus.

A case is a function of a `Context` (the fixtures, its own input directory `c.inp`,
and its own output directory `c.out`, the command's working directory) that writes
whatever broken input it needs and returns (argv, names): the caffepy arguments and
the strings its one error line must contain (a file, a layer, a field, a key).
`@case(category, code=..., send=...)` registers it; `code` is the exit code it must
end with; `send` ({"signal", "stderr" or "path"}) a signal the runner sends once the
command's stderr holds the text or a file matching the glob exists in `c.out`.
"""
import os
import shutil
import struct
import sys

import cv2
import numpy as np

from caffepy import prototxt
from caffepy.blobproto import array_to_blobproto, write_blobproto
from caffepy.proto import caffe_pb2

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import make_db, put_raw  # noqa: E402

CASES = []


class Case:
    def __init__(self, fn, category, code, send=None):
        self.fn, self.category, self.code, self.send = fn, category, code, send
        self.name = fn.__name__

    def __repr__(self):
        return self.name


def case(category, code=1, send=None):
    def register(fn):
        CASES.append(Case(fn, category, code, send))
        return fn
    return register


class Context:
    def __init__(self, fx, inp, out):
        self.fx, self.inp, self.out = fx, inp, out

    def write(self, name, content):
        path = os.path.join(self.inp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        return path

    def copy_db(self, name="db"):
        path = os.path.join(self.inp, name)
        shutil.copytree(self.fx.db, path)
        return path

    def data_mdb(self, db):
        with open(os.path.join(db, "data.mdb"), "rb") as f:
            return bytearray(f.read())

    def save_mdb(self, db, data):
        with open(os.path.join(db, "data.mdb"), "wb") as f:
            f.write(data)


# -- fixtures -----------------------------------------------------------------------
SHAPE = (3, 32, 32)      # 3 KB records: each lives on its own LMDB overflow page

CONV_IP = """
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 5 stride: 2 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
"""

DEPLOY = """name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 32 dim: 32 } } }
""" + CONV_IP + """layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }
"""


def data_layer(source, batch=4, transform="scale: 0.00390625", extra=""):
    return (f'layer {{ name: "data" type: "Data" top: "data" top: "label"\n'
            f'  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB {extra} }}\n'
            f'  transform_param {{ {transform} }} }}\n')


LOSS = """layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip1" bottom: "label" top: "acc" include { phase: TEST } }
"""


def train_val(source, **kw):
    return 'name: "tiny"\n' + data_layer(source, **kw) + CONV_IP + LOSS


def solver(net, extra=""):
    return (f'net: "{net}"\nbase_lr: 0.01 momentum: 0.9 lr_policy: "fixed"\nmax_iter: 2 display: 1\n'
            f'snapshot_prefix: "snap"\nrandom_seed: 1\n{extra}')


class Fixtures:
    """The good inputs every case starts from, built once in `root`."""

    def __init__(self, root):
        self.root = root
        os.makedirs(root)
        j = lambda name: os.path.join(root, name)    # noqa: E731
        rng = np.random.default_rng(0)
        values = [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(24)]
        self.db = make_db(j("db"), 24, shape=SHAPE, values=values)
        self.deploy = j("deploy.prototxt")
        self.train_val = j("train_val.prototxt")
        self.solver = j("solver.prototxt")
        self.weights = j("tiny.caffemodel")
        self.state = j("tiny.solverstate")
        self.mean = j("mean.binaryproto")
        self.images = j("images") + "/"
        self.list = j("list.txt")
        self.log = j("train.log")
        with open(self.deploy, "w") as f:
            f.write(DEPLOY)
        with open(self.train_val, "w") as f:
            f.write(train_val(self.db))
        with open(self.solver, "w") as f:
            f.write(solver(self.train_val))
        from caffepy import log
        from caffepy.net import TEST, Net
        log.set_quiet(True)
        net = Net(self.deploy, phase=TEST)
        net.save(self.weights)
        self.param_shapes = [b.shape for layer in net.layers for b in layer.blobs]
        state = caffe_pb2.SolverState(iter=1, learned_net=self.weights, current_step=0)
        for shape in self.param_shapes:
            state.history.append(array_to_blobproto(np.zeros(shape, np.float32)))
        prototxt.write_binary(state, self.state)
        write_blobproto(np.full((1,) + SHAPE, 100, np.float32), self.mean, legacy_shape=True)
        os.makedirs(self.images)
        lines = []
        for i in range(4):
            cv2.imwrite(f"{self.images}im{i}.png", rng.integers(0, 256, (10, 12, 3), dtype=np.uint8))
            lines.append(f"im{i}.png {i % 2}")
        cv2.imwrite(f"{self.images}wide.png", rng.integers(0, 256, (10, 20, 3), dtype=np.uint8))
        with open(self.list, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(self.log, "w") as f:
            f.write("I1122 13:39:22.381027 12345 solver.py:204] Iteration 0, loss = 2.3\n")
        # long enough to be interrupted half way: 60000 tiny records, 30000 list lines
        self.big_db = make_db(j("big_db"), 60000, shape=(1, 2, 2))
        self.long_list = j("long_list.txt")
        with open(self.long_list, "w") as f:
            f.write("".join(f"im{i % 4}.png {i % 2}\n" for i in range(30000)))


def time_args(model, *more):
    return ["time", "--model", model, "--iterations", "1", *more]


# =====================================================================================
# syntax: prototxt text that does not parse

def _bad_net(c, text, name="net.prototxt"):
    return c.write(name, text)


@case("syntax")
def unclosed_brace(c):
    p = _bad_net(c, DEPLOY + 'layer { name: "x" type: "ReLU" bottom: "prob" top: "x"\n')
    return time_args(p), [p, "'{' is not closed"]


@case("syntax")
def stray_closing_brace(c):
    p = _bad_net(c, DEPLOY + "}\n")
    return time_args(p), [p + ":"]


@case("syntax")
def number_expected(c):
    p = _bad_net(c, DEPLOY.replace("num_output: 10", "num_output: ten"))
    return time_args(p), [p + ":", "num_output", "ten"]


@case("syntax")
def number_out_of_range(c):
    p = _bad_net(c, DEPLOY.replace("num_output: 10", "num_output: 99999999999"))
    return time_args(p), [p + ":", "num_output", "out of range"]


@case("syntax")
def negative_unsigned(c):
    p = _bad_net(c, DEPLOY.replace("kernel_size: 5", "kernel_size: -5"))
    return time_args(p), [p + ":", "kernel_size"]


@case("syntax")
def unquoted_string(c):
    p = _bad_net(c, DEPLOY.replace('type: "ReLU"', "type: ReLU"))
    return time_args(p), [p + ":", "type", "quoted string"]


@case("syntax")
def singular_field_twice(c):
    p = _bad_net(c, DEPLOY.replace("num_output: 10", "num_output: 10 num_output: 11"))
    return time_args(p), [p + ":", "num_output", "more than once"]


@case("syntax")
def not_utf8(c):
    p = _bad_net(c, DEPLOY.encode() + b'# \xff\xfe caf\xe9\n')
    return time_args(p), [p + ":", "not UTF-8"]


@case("syntax")
def binary_as_prototxt(c):
    p = _bad_net(c, bytes(range(256)) * 4)
    return time_args(p), [p]


@case("syntax")
def caffemodel_as_model(c):
    return time_args(c.fx.weights), [c.fx.weights, "binary file"]


@case("syntax")
def empty_net(c):
    p = _bad_net(c, "")
    return time_args(p), [p, "empty"]


@case("syntax")
def comments_only_net(c):
    p = _bad_net(c, "# nothing here\n\n")
    return time_args(p), [p, "no layers"]


@case("syntax")
def missing_model(c):
    p = os.path.join(c.inp, "nope.prototxt")
    return time_args(p), [p, "cannot open"]


@case("syntax")
def directory_as_model(c):
    return time_args(c.inp), [c.inp]


@case("syntax")
def huge_line_with_error(c):
    dims = " ".join(["dim: 1"] * 20_000)
    p = _bad_net(c, f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }} oops\n')
    return time_args(p), [p + ":"]


@case("syntax")
def solver_syntax(c):
    p = c.write("solver.prototxt", solver(c.fx.train_val) + "base_lr 0.1\n")
    return ["train", "--solver", p], [p + ":"]


@case("syntax")
def empty_solver(c):
    p = c.write("solver.prototxt", "")
    return ["train", "--solver", p], [p, "empty"]


@case("syntax")
def solver_names_missing_net(c):
    p = c.write("solver.prototxt", solver(os.path.join(c.inp, "nope.prototxt")))
    return ["train", "--solver", p], [p, "nope.prototxt"]


@case("syntax")
def solver_with_empty_net(c):
    net = c.write("net.prototxt", "")
    p = c.write("solver.prototxt", solver(net))
    return ["train", "--solver", p], [net, "empty"]


# =====================================================================================
# names: unknown fields, enum values, layer types, solver types

@case("names")
def unknown_field(c):
    p = _bad_net(c, DEPLOY.replace("num_output: 10", "num_outptu: 10"))
    return time_args(p), [p + ":", "num_outptu", "did you mean 'num_output'"]


@case("names")
def unknown_top_level_field(c):
    p = _bad_net(c, "nme: 'x'\n" + DEPLOY)
    return time_args(p), [p + ":1:", "nme"]


@case("names")
def unknown_enum(c):
    p = _bad_net(c, DEPLOY + 'layer { name: "p" type: "Pooling" bottom: "conv1" top: "p" '
                 'pooling_param { pool: MAXX kernel_size: 2 } }\n')
    return time_args(p), [p + ":", "MAXX", "pool", "MAX, AVE"]


@case("names")
def unknown_phase(c):
    p = _bad_net(c, DEPLOY.replace('type: "Softmax"', 'type: "Softmax" include { phase: TRAINING }'))
    return time_args(p), [p + ":", "TRAINING", "TRAIN, TEST"]


@case("names")
def unknown_layer_type(c):
    p = _bad_net(c, DEPLOY.replace('type: "InnerProduct"', 'type: "InnerProdcut"'))
    return time_args(p), [p + ":", "layer 'ip1'", "InnerProdcut", "did you mean 'InnerProduct'"]


@case("names")
def layer_type_wrong_case(c):
    p = _bad_net(c, DEPLOY.replace('type: "ReLU"', 'type: "relu"'))
    return time_args(p), [p + ":", "layer 'relu1'", "did you mean 'ReLU'"]


@case("names")
def unknown_v1_type(c):
    p = _bad_net(c, 'layers { name: "x" type: RELUU }\n')
    return time_args(p), [p + ":", "RELUU"]


@case("names")
def unknown_solver_type(c):
    p = c.write("solver.prototxt", solver(c.fx.train_val, 'type: "SGDD"'))
    return ["train", "--solver", p], [p, "SGDD"]


@case("names")
def unknown_lr_policy(c):
    p = c.write("solver.prototxt", solver(c.fx.train_val).replace('"fixed"', '"fixd"'))
    return ["train", "--solver", p], [p, "lr_policy", "fixd"]


@case("names")
def unknown_filler(c):
    p = _bad_net(c, DEPLOY.replace('type: "xavier"', 'type: "xaviar"', 1))
    return time_args(p), [p, "conv1", "xaviar"]


@case("names", code=2)
def unknown_engine_flag(c):
    return time_args(c.fx.deploy, "-engine", "BOGUS_ENGINE"), ["--engine", "unknown engine", "BOGUS_ENGINE"]


@case("names", code=2)
def engine_flag_with_caffes_subengine(c):
    return time_args(c.fx.deploy, "-engine", "CAFFE:CPU"), ["--engine", "CAFFE takes no subengines"]


@case("names")
def unknown_net_engine(c):
    p = _bad_net(c, 'engine: "BOGUS_ENGINE"\n' + DEPLOY)
    return time_args(p), [p + ": engine", "unknown engine", "BOGUS_ENGINE"]


@case("names")
def unknown_layer_engine(c):
    p = _bad_net(c, DEPLOY.replace('type: "Convolution"', 'type: "Convolution" engine: "MKLDNN:GPU"'))
    return time_args(p), [p + ":", "layer 'conv1'", "engine", "subengine 'GPU'"]


@case("names")
def gpu_engine_in_a_param(c):
    p = _bad_net(c, DEPLOY.replace("num_output: 4", "num_output: 4 engine: CUDNN"))
    return time_args(p), [p + ":", "layer 'conv1'", "convolution_param.engine", "CUDNN"]


@case("names")
def unknown_solver_engine(c):
    p = c.write("solver.prototxt", solver(c.fx.train_val, 'engine: "BOGUS_ENGINE"'))
    return ["train", "--solver", p], [p + ": engine", "unknown engine", "BOGUS_ENGINE"]


@case("solver_values")
def multiphase_first_phase_without_solver_params(c):
    p = c.write("solver.prototxt", "params_pair { batch_size: 4 }\n")
    return ["train", "--solver", p], [p, "params_pair[0]", "solver_params"]


# =====================================================================================
# wiring: bottoms, tops and counts that do not connect

@case("wiring")
def missing_bottom(c):
    p = _bad_net(c, DEPLOY.replace('bottom: "ip1" top: "prob"', 'bottom: "ip2" top: "prob"'))
    return time_args(p), [p + ":", "layer 'prob'", "bottom", "'ip2'"]


@case("wiring")
def top_produced_twice(c):
    p = _bad_net(c, DEPLOY + 'layer { name: "again" type: "Softmax" bottom: "ip1" top: "prob" }\n')
    return time_args(p), [p + ":", "layer 'again'", "'prob'"]


@case("wiring")
def too_few_bottoms(c):
    p = _bad_net(c, DEPLOY + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "prob" top: "l" }\n')
    return time_args(p), [p + ":", "layer 'loss'", "bottom"]


@case("wiring")
def propagate_down_count(c):
    p = _bad_net(c, DEPLOY.replace('bottom: "ip1" top: "prob"',
                                   'bottom: "ip1" top: "prob" propagate_down: true propagate_down: false'))
    return time_args(p), [p + ":", "layer 'prob'", "propagate_down"]


@case("wiring")
def loss_weight_count(c):
    p = _bad_net(c, DEPLOY.replace('bottom: "ip1" top: "prob"',
                                   'bottom: "ip1" top: "prob" loss_weight: 1 loss_weight: 2'))
    return time_args(p), [p + ":", "layer 'prob'", "loss_weight"]


@case("wiring")
def include_and_exclude(c):
    p = _bad_net(c, DEPLOY.replace('type: "Softmax"', 'type: "Softmax" include { phase: TEST } '
                                   'exclude { phase: TRAIN }'))
    return time_args(p), [p + ":", "layer 'prob'", "include, exclude"]


@case("wiring")
def concat_mismatch(c):
    p = _bad_net(c, DEPLOY + 'layer { name: "cat" type: "Concat" bottom: "conv1" bottom: "ip1" top: "cat" }\n')
    return time_args(p), [p + ":", "layer 'cat'"]


_BN = 'layer { name: "bn1" type: "BatchNorm" bottom: "ip1" top: "bn1" %s }\n'


@case("wiring")
def bn_stats_batch_size_not_dividing_the_batch(c):
    p = _bad_net(c, "bn_stats_batch_size: 3\n" + DEPLOY + _BN % "")
    return time_args(p), [p + ":", "layer 'bn1'", "NetParameter.bn_stats_batch_size", "(2,", "got 3"]


@case("wiring")
def stats_batch_size_not_dividing_the_batch(c):
    p = _bad_net(c, DEPLOY + _BN % "batch_norm_param { stats_batch_size: 4 }")
    return time_args(p), [p + ":", "layer 'bn1'", "batch_norm_param.stats_batch_size", "(2,", "got 4"]


@case("wiring")
def label_smoothing_of_one(c):
    p = _bad_net(c, train_val(c.fx.db).replace('top: "loss"', 'top: "loss" loss_param { label_smoothing: 1 }'))
    return time_args(p), [p + ":", "layer 'loss'", "loss_param.label_smoothing", "[0, 1)", "got 1"]


@case("wiring")
def eltwise_mismatch(c):
    p = _bad_net(c, DEPLOY + 'layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "ip1" top: "sum" }\n')
    return time_args(p), [p + ":", "layer 'sum'"]


@case("wiring")
def shared_param_mismatch(c):
    extra = ('layer { name: "ipa" type: "InnerProduct" bottom: "ip1" top: "ipa" param { name: "w" } '
             'inner_product_param { num_output: 3 } }\n'
             'layer { name: "ipb" type: "InnerProduct" bottom: "ip1" top: "ipb" param { name: "w" } '
             'inner_product_param { num_output: 4 } }\n')
    p = _bad_net(c, DEPLOY + extra)
    return time_args(p), [p + ":", "layer 'ipb'", "param 'w'"]


@case("wiring")
def too_many_param_specs(c):
    p = _bad_net(c, DEPLOY.replace('type: "ReLU"', 'type: "ReLU" param { lr_mult: 1 }'))
    return time_args(p), [p + ":", "layer 'relu1'", "param"]


# =====================================================================================
# sizes: shapes that do not fit, absurd sizes, overflowing and negative dims

@case("sizes")
def inner_product_num_output_2e9(c):
    p = _bad_net(c, DEPLOY.replace("num_output: 10", "num_output: 2000000000"))
    return time_args(p), [p + ":", "layer 'ip1'", "inner_product_param.num_output", "2000000000",
                          "memory available"]


@case("sizes")
def convolution_num_output_2e9(c):
    p = _bad_net(c, DEPLOY.replace("num_output: 4", "num_output: 2000000000"))
    return time_args(p), [p + ":", "layer 'conv1'", "convolution_param.num_output", "memory available"]


@case("sizes")
def dummy_data_batch_1e9(c):
    p = _bad_net(c, 'layer { name: "d" type: "DummyData" top: "d" '
                 'dummy_data_param { shape { dim: 1000000000 dim: 3 dim: 224 dim: 224 } } }\n')
    return time_args(p), [p + ":", "layer 'd'", "dummy_data_param.shape.dim", "1000000000"]


@case("sizes")
def dummy_data_legacy_num_1e9(c):
    p = _bad_net(c, 'layer { name: "d" type: "DummyData" top: "d" '
                 'dummy_data_param { num: 1000000000 channels: 3 height: 224 width: 224 } }\n')
    return time_args(p), [p + ":", "layer 'd'", "dummy_data_param.num", "1000000000"]


@case("sizes")
def dummy_data_negative_dim(c):
    p = _bad_net(c, 'layer { name: "d" type: "DummyData" top: "d" '
                 'dummy_data_param { shape { dim: 2 dim: -3 } } }\n')
    return time_args(p), [p + ":", "layer 'd'", "dummy_data_param.shape.dim", "negative", "-3"]


@case("sizes")
def data_batch_1e9(c):
    p = _bad_net(c, train_val(c.fx.db, batch=1000000000))
    return time_args(p), [p + ":", "layer 'data'", "data_param.batch_size", "1000000000"]


@case("sizes")
def input_shape_overflows_64_bits(c):
    p = _bad_net(c, DEPLOY.replace("dim: 2 dim: 3 dim: 32 dim: 32",
                                   "dim: 4294967296 dim: 4294967296 dim: 4294967296 dim: 1"))
    return time_args(p), [p + ":", "layer 'data'", "input_param.shape.dim", "4294967296"]


@case("sizes")
def input_shape_zero_and_huge(c):
    p = _bad_net(c, DEPLOY.replace("dim: 2 dim: 3 dim: 32 dim: 32",
                                   "dim: 0 dim: 4611686018427387904 dim: 4611686018427387904"))
    return time_args(p), [p + ":", "layer 'data'", "4611686018427387904"]


@case("sizes")
def input_negative_dim(c):
    p = _bad_net(c, DEPLOY.replace("dim: 2 dim: 3", "dim: -2 dim: 3"))
    return time_args(p), [p + ":", "layer 'data'", "negative"]


@case("sizes")
def enormous_repeated_field(c):
    dims = " ".join(["dim: 1"] * 20_000)
    p = _bad_net(c, f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }}\n')
    return time_args(p), [p + ":", "layer 'data'"]


@case("sizes")
def memory_data_batch_1e9(c):
    p = _bad_net(c, 'layer { name: "m" type: "MemoryData" top: "m" top: "l" memory_data_param { '
                 'batch_size: 1000000000 channels: 3 height: 227 width: 227 } }\n')
    return time_args(p), [p + ":", "layer 'm'", "memory_data_param.batch_size", "1000000000"]


@case("sizes")
def image_data_huge_resize(c):
    lst = c.write("list.txt", "im0.png 0\n")
    p = _bad_net(c, f'layer {{ name: "img" type: "ImageData" top: "data" top: "label" image_data_param {{ '
                 f'source: "{lst}" root_folder: "{c.fx.images}" batch_size: 1 new_height: 1000000 '
                 f'new_width: 1000000 }} }}\n')
    return time_args(p), [p + ":", "layer 'img'", "image_data_param.source", "im0.png", "1000000 x 1000000"]


@case("sizes")
def kernel_larger_than_input(c):
    p = _bad_net(c, DEPLOY.replace("kernel_size: 5", "kernel_size: 40"))
    return time_args(p), [p + ":", "layer 'conv1'", "kernel"]


@case("sizes")
def pooling_kernel_larger(c):
    p = _bad_net(c, DEPLOY + 'layer { name: "p" type: "Pooling" bottom: "conv1" top: "p" '
                 'pooling_param { pool: MAX kernel_size: 30 } }\n')
    return time_args(p), [p + ":", "layer 'p'"]


@case("sizes")
def crop_larger_than_image(c):
    p = _bad_net(c, train_val(c.fx.db, transform="crop_size: 64"))
    return time_args(p), [p + ":", "layer 'data'", "crop_size", "64"]


@case("sizes")
def reshape_bad_count(c):
    p = _bad_net(c, DEPLOY + 'layer { name: "r" type: "Reshape" bottom: "ip1" top: "r" '
                 'reshape_param { shape { dim: 7 dim: -1 } } }\n')
    return time_args(p), [p + ":", "layer 'r'"]


@case("sizes")
def data_batch_zero(c):
    p = _bad_net(c, train_val(c.fx.db, batch=0))
    return time_args(p), [p + ":", "layer 'data'", "batch_size"]


@case("sizes")
def group_does_not_divide(c):
    p = _bad_net(c, DEPLOY.replace("num_output: 4 kernel_size: 5", "num_output: 4 group: 3 kernel_size: 5"))
    return time_args(p), [p + ":", "layer 'conv1'", "group"]


@case("sizes")
def stride_zero(c):
    p = _bad_net(c, DEPLOY.replace("stride: 2", "stride: 0"))
    return time_args(p), [p + ":", "layer 'conv1'", "stride"]


# =====================================================================================
# caffemodel: weights files that are empty, foreign, truncated or do not fit

def test_args(c, weights, model=None):
    return ["test", "--model", model or c.fx.deploy, "--weights", weights, "--iterations", "1"]


def _net_param(path):
    return prototxt.read_binary(caffe_pb2.NetParameter(), path)


@case("caffemodel")
def empty_caffemodel(c):
    w = c.write("w.caffemodel", b"")
    return test_args(c, w), [w, "empty"]


@case("caffemodel")
def garbage_caffemodel(c):
    w = c.write("w.caffemodel", os.urandom(4000))
    return test_args(c, w), [w]


@case("caffemodel")
def truncated_caffemodel(c):
    data = open(c.fx.weights, "rb").read()
    w = c.write("w.caffemodel", data[: len(data) // 2])
    return test_args(c, w), [w]


@case("caffemodel")
def prototxt_as_weights(c):
    return test_args(c, c.fx.deploy), [c.fx.deploy, "text prototxt"]


@case("caffemodel")
def weights_of_another_net(c):
    net = _net_param(c.fx.weights)
    for layer in net.layer:
        layer.name = "other_" + layer.name
    w = c.write("w.caffemodel", net.SerializeToString())
    return test_args(c, w), [w, "no layer of the net got weights", "other_conv1", "conv1"]


@case("caffemodel")
def weights_with_no_layers(c):
    w = c.write("w.caffemodel", caffe_pb2.NetParameter(name="empty").SerializeToString())
    return test_args(c, w), [w, "no layer of the net got weights"]


@case("caffemodel")
def wrong_value_count(c):
    net = _net_param(c.fx.weights)
    blob = [layer for layer in net.layer if layer.name == "ip1"][0].blobs[0]
    values = list(blob.data)[:-3]
    del blob.data[:]
    blob.data.extend(values)
    w = c.write("w.caffemodel", net.SerializeToString())
    return test_args(c, w), [w + ":", "layer 'ip1'", "blobs[0]", "data"]


@case("caffemodel")
def wrong_blob_shape(c):
    net = _net_param(c.fx.weights)
    blob = [layer for layer in net.layer if layer.name == "ip1"][0].blobs[0]
    dims = list(blob.shape.dim)
    blob.shape.ClearField("dim")
    blob.shape.dim.extend([dims[1], dims[0]])
    w = c.write("w.caffemodel", net.SerializeToString())
    return test_args(c, w), [w + ":", "layer 'ip1'", "blobs[0]", "shape"]


@case("caffemodel")
def wrong_blob_count(c):
    net = _net_param(c.fx.weights)
    layer = [layer for layer in net.layer if layer.name == "conv1"][0]
    del layer.blobs[1]
    w = c.write("w.caffemodel", net.SerializeToString())
    return test_args(c, w), [w + ":", "layer 'conv1'", "parameter blobs"]


@case("caffemodel")
def blob_shape_overflows_64_bits(c):
    net = _net_param(c.fx.weights)
    blob = [layer for layer in net.layer if layer.name == "ip1"][0].blobs[0]
    blob.shape.ClearField("dim")
    blob.shape.dim.extend([2**32, 2**32])
    del blob.data[:]
    w = c.write("w.caffemodel", net.SerializeToString())
    return test_args(c, w), [w + ":", "layer 'ip1'", "blobs[0]", "18446744073709551616"]


@case("caffemodel")
def blob_negative_legacy_dims(c):
    net = _net_param(c.fx.weights)
    blob = [layer for layer in net.layer if layer.name == "ip1"][0].blobs[1]
    blob.ClearField("shape")
    blob.num, blob.channels, blob.height, blob.width = -1, -10, 1, 1
    w = c.write("w.caffemodel", net.SerializeToString())
    return test_args(c, w), [w + ":", "layer 'ip1'", "blobs[1]", "negative"]


@case("caffemodel")
def hdf5_weights(c):
    w = c.write("w.h5", b"\x89HDF\r\n\x1a\n")
    return test_args(c, w), [w, "HDF5"]


@case("caffemodel")
def missing_weights(c):
    w = os.path.join(c.inp, "nope.caffemodel")
    return test_args(c, w), [w, "cannot open"]


@case("caffemodel")
def empty_weights_for_time(c):
    w = c.write("w.caffemodel", b"")
    return time_args(c.fx.deploy, "--weights", w), [w, "empty"]


@case("caffemodel")
def empty_weights_for_finetune(c):
    w = c.write("w.caffemodel", b"")
    return ["train", "--solver", c.fx.solver, "--weights", w], [w, "empty"]


# =====================================================================================
# solverstate: resuming from states that are empty, foreign or do not fit

def resume_args(c, state):
    return ["train", "--solver", c.fx.solver, "--snapshot", state]


@case("solverstate")
def empty_solverstate(c):
    s = c.write("s.solverstate", b"")
    return resume_args(c, s), [s, "empty"]


@case("solverstate")
def garbage_solverstate(c):
    s = c.write("s.solverstate", b"\x08" + os.urandom(3000))
    return resume_args(c, s), [s]


@case("solverstate")
def truncated_solverstate(c):
    data = open(c.fx.state, "rb").read()
    s = c.write("s.solverstate", data[: len(data) - 7])
    return resume_args(c, s), [s]


@case("solverstate", code=2)
def caffemodel_as_snapshot(c):
    return resume_args(c, c.fx.weights), [c.fx.weights, "--snapshot", "--weights"]


@case("solverstate", code=2)
def caffemodel_renamed_as_snapshot(c):
    s = c.write("renamed.solverstate", open(c.fx.weights, "rb").read())
    return resume_args(c, s), [s, "--snapshot", "--weights"]


@case("solverstate")
def missing_solverstate(c):
    s = os.path.join(c.inp, "nope.solverstate")
    return resume_args(c, s), [s]


@case("solverstate")
def state_names_missing_weights(c):
    state = prototxt.read_binary(caffe_pb2.SolverState(), c.fx.state)
    state.learned_net = os.path.join(c.inp, "gone.caffemodel")
    s = c.write("s.solverstate", state.SerializeToString())
    return resume_args(c, s), [s, "learned_net", "gone.caffemodel"]


@case("solverstate")
def state_history_count(c):
    state = prototxt.read_binary(caffe_pb2.SolverState(), c.fx.state)
    del state.history[1:]
    s = c.write("s.solverstate", state.SerializeToString())
    return resume_args(c, s), [s, "history"]


@case("solverstate")
def state_history_values(c):
    state = prototxt.read_binary(caffe_pb2.SolverState(), c.fx.state)
    del state.history[0].data[1:]
    s = c.write("s.solverstate", state.SerializeToString())
    return resume_args(c, s), [s, "history[0]", "has 1 values"]


@case("solverstate")
def state_hdf5(c):
    s = c.write("s.solverstate.h5", b"\x89HDF\r\n\x1a\n")
    return resume_args(c, s), [s, "HDF5"]


def _with_extension(c, field, payload, state=None):
    """The fixture's solverstate (or `state`) with extension `field` holding `payload`."""
    from caffepy.solvers import snapshot
    state = state or prototxt.read_binary(caffe_pb2.SolverState(), c.fx.state)
    state.MergeFromString(snapshot._extension_bytes(field, payload))
    return c.write("s.solverstate", state.SerializeToString())


def _run_state(**layer):
    """A run state for one rank whose data layer's position is the good one, changed by `layer`."""
    import json
    from caffepy import rng
    data = {"records": 24, "ranks": 1, "seed": 5, "skip": 0, "reads": 8, "transform": rng.get_state()}
    data.update(layer)
    return json.dumps({"ranks": [{"rng": rng.get_state(), "layers": {"data": data}}]}).encode()


@case("solverstate")
def state_negative_iter(c):
    state = prototxt.read_binary(caffe_pb2.SolverState(), c.fx.state)
    state.iter = -5
    s = c.write("s.solverstate", state.SerializeToString())
    return resume_args(c, s), [s, "iter", "-5"]


@case("solverstate")
def state_negative_current_step(c):
    state = prototxt.read_binary(caffe_pb2.SolverState(), c.fx.state)
    state.current_step = -1
    s = c.write("s.solverstate", state.SerializeToString())
    return resume_args(c, s), [s, "current_step", "-1"]


@case("solverstate")
def state_deeply_nested_rng(c):
    s = _with_extension(c, 1001, b"[" * 20_000 + b"]" * 20_000)      # json.loads: RecursionError
    return resume_args(c, s), [s, "random generator state", "nested deeper", "20000 levels"]


@case("solverstate")
def state_huge_rng(c):
    s = _with_extension(c, 1001, b'"' + b"x" * 100_000 + b'"')
    return resume_args(c, s), [s, "random generator state", "100002 bytes"]


@case("solverstate")
def state_rng_not_json(c):
    s = _with_extension(c, 1001, b"\xff{not json")
    return resume_args(c, s), [s, "random generator state", "not JSON"]


@case("solverstate")
def state_rng_of_another_generator(c):
    import json
    s = _with_extension(c, 1001, json.dumps({"bit_generator": "MT19937", "state": {"key": [1, 2], "pos": 3}})
                        .encode())
    return resume_args(c, s), [s, "random generator state", "MT19937"]


@case("solverstate")
def state_rng_negative_number(c):
    import json
    from caffepy import rng
    state = rng.get_state()
    state["state"]["inc"] = -7
    s = _with_extension(c, 1001, json.dumps(state).encode())
    return resume_args(c, s), [s, "random generator state", "inc", "-7"]


@case("solverstate")
def state_run_state_deeply_nested(c):
    s = _with_extension(c, 1002, b'{"ranks": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    return resume_args(c, s), [s, "run state", "nested deeper"]


@case("solverstate")
def state_run_state_not_per_rank(c):
    s = _with_extension(c, 1002, b'{"ranks": 3}')
    return resume_args(c, s), [s, "run state", '"ranks": 3']


@case("solverstate")
def state_run_state_negative_reads(c):
    s = _with_extension(c, 1002, _run_state(reads=-40))
    return resume_args(c, s), [s, "run state: ranks[0]: layer 'data'", "reads", "-40"]


@case("solverstate")
def state_run_state_bad_transform(c):
    s = _with_extension(c, 1002, _run_state(transform={"bit_generator": "PCG64"}))
    return resume_args(c, s), [s, "layer 'data'", "transform", "not a generator state"]


# =====================================================================================
# solver_values: settings Caffe CHECKs (or that would wreck the first update)

def _solver_with(c, extra, base=None):
    text = base if base is not None else solver(c.fx.train_val)
    s = c.write("solver.prototxt", text + extra + "\n")
    return ["train", "--solver", s], s


@case("solver_values")
def negative_base_lr(c):
    args, s = _solver_with(c, "", solver(c.fx.train_val).replace("base_lr: 0.01", "base_lr: -0.01"))
    return args, [s, "base_lr", "-0.01"]


@case("solver_values")
def nan_base_lr(c):
    args, s = _solver_with(c, "", solver(c.fx.train_val).replace("base_lr: 0.01", "base_lr: nan"))
    return args, [s, "base_lr", "nan"]


@case("solver_values")
def infinite_momentum(c):
    args, s = _solver_with(c, "", solver(c.fx.train_val).replace("momentum: 0.9", "momentum: inf"))
    return args, [s, "momentum", "inf"]


@case("solver_values")
def negative_momentum(c):
    args, s = _solver_with(c, "", solver(c.fx.train_val).replace("momentum: 0.9", "momentum: -0.9"))
    return args, [s, "momentum", "-0.9"]


@case("solver_values")
def negative_weight_decay(c):
    args, s = _solver_with(c, "weight_decay: -0.0005")
    return args, [s, "weight_decay", "-0.0005"]


@case("solver_values")
def negative_delta(c):
    args, s = _solver_with(c, 'type: "AdaDelta" delta: -1e-6',
                           solver(c.fx.train_val).replace("momentum: 0.9", "momentum: 0.95"))
    return args, [s, "delta", "-1e-06"]


@case("solver_values")
def nan_momentum2(c):
    args, s = _solver_with(c, 'type: "Adam" momentum2: nan')
    return args, [s, "momentum2", "nan"]


@case("solver_values")
def adam_beta1_of_one(c):
    args, s = _solver_with(c, 'type: "Adam"', solver(c.fx.train_val).replace("momentum: 0.9", "momentum: 1"))
    return args, [s, "momentum", "Adam", "got 1"]


@case("solver_values")
def negative_gamma(c):
    args, s = _solver_with(c, "gamma: -0.1 stepsize: 10", solver(c.fx.train_val).replace('"fixed"', '"step"'))
    return args, [s, "gamma", "-0.1"]


@case("solver_values")
def sigmoid_without_stepsize(c):
    args, s = _solver_with(c, "gamma: 0.1", solver(c.fx.train_val).replace('"fixed"', '"sigmoid"'))
    return args, [s, "stepsize", "sigmoid"]


@case("solver_values")
def inv_with_nan_power(c):
    args, s = _solver_with(c, "gamma: 0.1 power: nan", solver(c.fx.train_val).replace('"fixed"', '"inv"'))
    return args, [s, "power", "nan"]


@case("solver_values")
def nan_clip_gradients(c):
    args, s = _solver_with(c, "clip_gradients: nan")
    return args, [s, "clip_gradients", "nan"]


@case("solver_values")
def rms_decay_of_one(c):
    args, s = _solver_with(c, 'type: "RMSProp" rms_decay: 1', solver(c.fx.train_val).replace("momentum: 0.9", ""))
    return args, [s, "rms_decay", "got 1"]


@case("solver_values")
def average_loss_zero(c):
    args, s = _solver_with(c, "average_loss: 0")
    return args, [s, "average_loss", "0"]


@case("solver_values")
def iter_size_zero(c):
    args, s = _solver_with(c, "iter_size: 0")
    return args, [s, "iter_size", "0"]


@case("solver_values")
def deploy_net_given_to_train(c):
    args, s = _solver_with(c, "", solver(c.fx.deploy))
    return args, [c.fx.deploy, "no loss layer", "deploy net"]


# =====================================================================================
# signals: Ctrl-C (SIGINT) half way through a command; the flags that say what a signal does

@case("signals", code=130, send={"signal": "SIGINT", "stderr": "Processed 1000 files."})
def sigint_convert_imageset(c):
    return ["convert_imageset", c.fx.images, c.fx.long_list, "out_lmdb"], ["convert_imageset", "SIGINT"]


@case("signals", code=130, send={"signal": "SIGINT", "path": ".shard_1.*.tmp"})
def sigint_split_db(c):
    return ["split_db", c.fx.big_db, "2", "shard"], ["split_db", "SIGINT"]


@case("signals", code=130, send={"signal": "SIGINT", "stderr": "Processed 10000 files."})
def sigint_compute_image_mean(c):
    return ["compute_image_mean", c.fx.big_db, "mean.binaryproto"], ["compute_image_mean", "SIGINT"]


@case("signals", code=130, send={"signal": "SIGINT", "stderr": "Batch 0,"})
def sigint_test(c):
    return ["test", "--model", c.fx.deploy, "--weights", c.fx.weights, "--iterations", "100000000"], [
        "test", "SIGINT"]


@case("signals", code=130, send={"signal": "SIGINT", "stderr": "Iteration: 1 forward-backward"})
def sigint_time(c):
    return time_args(c.fx.deploy)[:-1] + ["100000000"], ["time", "SIGINT"]


@case("signals", code=2)
def unknown_sigint_effect(c):
    return ["train", "--solver", c.fx.solver, "--sigint_effect", "explode"], ["--sigint_effect", "explode"]


@case("signals", code=2)
def unknown_sighup_effect(c):
    return ["train", "--solver", c.fx.solver, "--sighup_effect", "Snapshot"], ["--sighup_effect", "Snapshot"]


# =====================================================================================
# mean: .binaryproto mean files

def mean_net(c, mean):
    return _bad_net(c, train_val(c.fx.db, transform=f'mean_file: "{mean}"'))


@case("mean")
def empty_mean(c):
    m = c.write("m.binaryproto", b"")
    p = mean_net(c, m)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", m, "empty"]


@case("mean")
def garbage_mean(c):
    m = c.write("m.binaryproto", os.urandom(500))
    p = mean_net(c, m)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", m]


@case("mean")
def truncated_mean(c):
    data = open(c.fx.mean, "rb").read()
    m = c.write("m.binaryproto", data[: len(data) // 2])
    p = mean_net(c, m)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", m]


@case("mean")
def mean_of_two_axes(c):
    m = os.path.join(c.inp, "m.binaryproto")
    write_blobproto(np.zeros((3, 1024), np.float32), m)
    p = mean_net(c, m)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", m, "3 x 1024"]


@case("mean")
def mean_of_other_image_size(c):
    m = os.path.join(c.inp, "m.binaryproto")
    write_blobproto(np.zeros((1, 3, 16, 16), np.float32), m)
    p = mean_net(c, m)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", m, "3x16x16", "3x32x32"]


@case("mean")
def mean_shape_overflows(c):
    bp = caffe_pb2.BlobProto()
    bp.shape.dim.extend([2**40, 2**40, 2**40])
    m = c.write("m.binaryproto", bp.SerializeToString())
    p = mean_net(c, m)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", m, "1329227995784915872903807060280344576"]


@case("mean")
def mean_value_count_mismatch(c):
    bp = array_to_blobproto(np.zeros((1, 3, 32, 32), np.float32))
    del bp.data[5:]
    m = c.write("m.binaryproto", bp.SerializeToString())
    p = mean_net(c, m)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", m, "has 5 values"]


@case("mean")
def missing_mean(c):
    m = os.path.join(c.inp, "nope.binaryproto")
    p = mean_net(c, m)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", m]


@case("mean")
def prototxt_as_mean(c):
    p = mean_net(c, c.fx.deploy)
    return time_args(p), [p + ":", "layer 'data'", "mean_file", c.fx.deploy]


# =====================================================================================
# augment: Intel Caffe's augmentations in transform_param with values that mean nothing

def augment_net(c, transform):
    return _bad_net(c, train_val(c.fx.db, transform=transform))


@case("augment")
def negative_area_ratio(c):
    p = augment_net(c, "crop_size: 24 random_aspect_ratio_param { min_area_ratio: -0.5 }")
    return time_args(p), [p + ":", "layer 'data'", "random_aspect_ratio_param.min_area_ratio", "-0.5"]


@case("augment")
def area_ratio_min_over_max(c):
    p = augment_net(c, "crop_size: 24 random_aspect_ratio_param { min_area_ratio: 0.9 max_area_ratio: 0.5 }")
    return time_args(p), [p + ":", "layer 'data'", "random_aspect_ratio_param.min_area_ratio", "0.9", "0.5"]


@case("augment")
def aspect_ratio_change_above_one(c):
    p = augment_net(c, "crop_size: 24 random_aspect_ratio_param { aspect_ratio_change: 1.25 }")
    return time_args(p), [p + ":", "layer 'data'", "random_aspect_ratio_param.aspect_ratio_change", "1.25"]


@case("augment")
def random_resize_min_over_max(c):
    p = augment_net(c, "crop_size: 24 random_resize_param { min_size: 40 max_size: 30 }")
    return time_args(p), [p + ":", "layer 'data'", "random_resize_param.min_size", "40", "30"]


@case("augment")
def random_resize_without_crop(c):
    p = augment_net(c, "random_resize_param { min_size: 40 max_size: 50 }")
    return time_args(p), [p + ":", "layer 'data'", "random_resize_param", "crop_size"]


@case("augment")
def probability_above_one(c):
    p = augment_net(c, "distort_param { brightness_prob: 1.5 brightness_delta: 32 }")
    return time_args(p), [p + ":", "layer 'data'", "distort_param.brightness_prob", "1.5"]


@case("augment")
def crop_larger_than_the_resize(c):
    p = augment_net(c, "crop_size: 24 resize_param { height: 16 width: 20 }")
    return time_args(p), [p + ":", "layer 'data'", "crop_size", "16x20", "24"]


@case("augment")
def expand_ratio_not_above_one(c):
    p = augment_net(c, "crop_size: 24 expand_param { max_expand_ratio: 0.5 }")
    return time_args(p), [p + ":", "layer 'data'", "expand_param.max_expand_ratio", "0.5"]


@case("augment")
def both_random_resizes(c):
    p = augment_net(c, "crop_size: 24 random_resize_param { min_size: 32 } "
                       "random_aspect_ratio_param { min_area_ratio: 0.5 }")
    return time_args(p), [p + ":", "layer 'data'", "random_aspect_ratio_param", "random_resize_param"]


@case("augment")
def emit_constraint_without_boxes(c):
    p = augment_net(c, "emit_constraint { emit_type: CENTER }")
    return time_args(p), [p + ":", "layer 'data'", "emit_constraint"]


# =====================================================================================
# detection: SSD's annotated records, label maps and annotation files

def _annotated_db(c, boxes, name="anno_lmdb"):
    """An LMDB of two AnnotatedDatum records (8 x 8 images): a good one, then one whose
    boxes are `boxes` [(label, (xmin, ymin, xmax, ymax))]."""
    from data_helpers import annotated_datum, make_annotated_db
    img = np.zeros((8, 8, 3), np.uint8)
    return make_annotated_db(os.path.join(c.inp, name), [
        annotated_datum(img, [(1, (.1, .1, .5, .5), False)]),
        annotated_datum(img, [(lab, box, False) for lab, box in boxes])])


def _annotated_net(c, db, extra=""):
    return _bad_net(c, f"""name: "ssd"
layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label"
  data_param {{ source: "{db}" batch_size: 2 }} annotated_data_param {{ {extra} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 2 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "silence" type: "Silence" bottom: "label" }}
""")


@case("detection")
def annotated_box_outside_the_image(c):
    db = _annotated_db(c, [(1, (.2, .1, 1.4, .5))])
    p = _annotated_net(c, db)
    return time_args(p), [p + ":", "layer 'data'", db, "key '00000001'", "lies outside the image", "1.4"]


@case("detection")
def annotated_box_inverted(c):
    db = _annotated_db(c, [(2, (.6, .1, .3, .5))])
    p = _annotated_net(c, db)
    return time_args(p), [p + ":", "layer 'data'", db, "key '00000001'", "inverted", "0.6, 0.1, 0.3, 0.5"]


@case("detection")
def annotated_label_missing_from_the_label_map(c):
    db = _annotated_db(c, [(7, (.1, .1, .3, .5))])
    lm = c.write("labelmap.prototxt", 'item { name: "bg" label: 0 } item { name: "a" label: 1 }\n')
    p = _annotated_net(c, db, f'label_map_file: "{lm}"')
    return time_args(p), [p + ":", "layer 'data'", db, "key '00000001'", "label 7", lm]


@case("detection")
def annotated_label_map_file_missing(c):
    db = _annotated_db(c, [(1, (.1, .1, .3, .5))])
    lm = os.path.join(c.inp, "no_labelmap.prototxt")
    p = _annotated_net(c, db, f'label_map_file: "{lm}"')
    # the label map's own field, not data_param.source's (the source is fine)
    return time_args(p), [p + ":", "layer 'data'", "annotated_data_param.label_map_file:", lm,
                          "cannot read the label map"]


@case("detection")
def annotated_batch_sampler_without_a_resize(c):
    db = _annotated_db(c, [(1, (.1, .1, .3, .5))])
    p = _annotated_net(c, db, "batch_sampler { sampler { min_scale: 0.3 } max_trials: 5 }")
    return time_args(p), [p + ":", "layer 'data'", "annotated_data_param.batch_sampler", "resize_param"]


def _voc(c, objects, size=(8, 8)):
    cv2.imwrite(os.path.join(c.inp, "a.jpg"), np.zeros((size[1], size[0], 3), np.uint8))
    obj = "".join(f"<object><name>{n}</name><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin><xmax>{b[2]}</xmax>"
                  f"<ymax>{b[3]}</ymax></bndbox></object>" for n, b in objects)
    xml = c.write("a.xml", f"<annotation><size><width>{size[0]}</width><height>{size[1]}</height></size>"
                           f"{obj}</annotation>")
    lst = c.write("list.txt", "a.jpg a.xml\n")
    lm = c.write("labelmap.prototxt", 'item { name: "none_of_the_above" label: 0 } item { name: "dog" label: 1 }\n')
    return ["convert_annoset", "--anno_type", "detection", "--label_map_file", lm, c.inp + os.sep, lst,
            "out_lmdb"], xml


@case("detection")
def annoset_name_missing_from_the_label_map(c):
    args, xml = _voc(c, [("dog", (1, 1, 4, 4)), ("cat", (2, 2, 5, 5))])
    return args, [xml, "object 2 ('cat')", "not in the label map", "dog"]


@case("detection")
def annoset_box_outside_the_image(c):
    args, xml = _voc(c, [("dog", (1, 1, 12, 4))])
    return args, [xml, "object 1 ('dog')", "outside the 8x8 image", "1, 1, 12, 4"]


@case("detection")
def annoset_box_inverted(c):
    args, xml = _voc(c, [("dog", (5, 1, 2, 4))])
    return args, [xml, "object 1 ('dog')", "inverted", "5, 1, 2, 4"]


# =====================================================================================
# lmdb: damaged databases, read by every command that reads one

def _truncated(c, keep=0.6):
    db = c.copy_db()
    data = c.data_mdb(db)
    c.save_mdb(db, data[: int(len(data) * keep)])
    return db


def _lmdb_net(c, db):
    return _bad_net(c, train_val(db))


@case("lmdb")
def truncated_lmdb_time(c):
    db = _truncated(c)
    return time_args(_lmdb_net(c, db)), [os.path.join(db, "data.mdb"), "truncated", "layer 'data'"]


@case("lmdb")
def truncated_lmdb_time_test_phase(c):
    db = _truncated(c)
    return time_args(_lmdb_net(c, db), "--phase", "TEST"), [os.path.join(db, "data.mdb"), "truncated"]


@case("lmdb")
def truncated_lmdb_test(c):
    db = _truncated(c)
    return test_args(c, c.fx.weights, _lmdb_net(c, db)), [os.path.join(db, "data.mdb"), "truncated"]


@case("lmdb")
def truncated_lmdb_train(c):
    db = _truncated(c)
    s = c.write("solver.prototxt", solver(_lmdb_net(c, db)))
    return ["train", "--solver", s], [os.path.join(db, "data.mdb"), "truncated"]


@case("lmdb")
def truncated_lmdb_compute_image_mean(c):
    db = _truncated(c)
    return ["compute_image_mean", db, "mean.binaryproto"], [os.path.join(db, "data.mdb"), "truncated"]


@case("lmdb")
def truncated_lmdb_split_db(c):
    db = _truncated(c)
    return ["split_db", db, "2", "shard"], [os.path.join(db, "data.mdb"), "truncated"]


@case("lmdb")
def truncated_lmdb_by_one_page(c):
    db = c.copy_db()
    data = c.data_mdb(db)
    c.save_mdb(db, data[:-4096])
    return ["compute_image_mean", db], [os.path.join(db, "data.mdb"), "truncated"]


@case("lmdb")
def lmdb_shorter_than_its_header(c):
    db = c.copy_db()
    c.save_mdb(db, c.data_mdb(db)[:100])
    return time_args(_lmdb_net(c, db)), [os.path.join(db, "data.mdb"), "shorter than LMDB's header"]


@case("lmdb")
def lmdb_missing_second_meta(c):
    db = c.copy_db()
    c.save_mdb(db, c.data_mdb(db)[:4096])
    return time_args(_lmdb_net(c, db)), [os.path.join(db, "data.mdb"), "second header page"]


@case("lmdb")
def empty_data_mdb(c):
    db = c.copy_db()
    c.save_mdb(db, b"")
    return time_args(_lmdb_net(c, db)), [os.path.join(db, "data.mdb"), "empty"]


@case("lmdb")
def zeroed_lmdb(c):
    db = c.copy_db()
    c.save_mdb(db, bytes(len(c.data_mdb(db))))
    return ["compute_image_mean", db], [os.path.join(db, "data.mdb"), "all zero bytes"]


@case("lmdb")
def garbage_lmdb(c):
    db = c.copy_db()
    c.save_mdb(db, np.random.default_rng(1).integers(0, 256, len(c.data_mdb(db)), np.uint8).tobytes())
    return time_args(_lmdb_net(c, db)), [os.path.join(db, "data.mdb"), "not an LMDB file"]


def _leaf(data):
    """Offset of the first leaf page (flags P_LEAF) of an LMDB file."""
    for off in range(2 * 4096, len(data), 4096):
        if struct.unpack_from("<H", data, off + 10)[0] & 0x02:
            return off
    raise AssertionError("no leaf page")


@case("lmdb")
def zeroed_leaf_page(c):
    db = c.copy_db()
    data = c.data_mdb(db)
    leaf = _leaf(data)
    data[leaf:leaf + 4096] = bytes(4096)
    c.save_mdb(db, data)
    return time_args(_lmdb_net(c, db)), [db, "layer 'data'", "damaged LMDB"]


@case("lmdb")
def garbage_leaf_page(c):
    db = c.copy_db()
    data = c.data_mdb(db)
    leaf = _leaf(data)
    data[leaf + 16:leaf + 4096] = np.random.default_rng(2).integers(0, 256, 4080, np.uint8).tobytes()
    c.save_mdb(db, data)
    return ["compute_image_mean", db], [db, "damaged LMDB"]


def _node(data, leaf, i):
    ptr = struct.unpack_from("<H", data, leaf + 16 + 2 * i)[0]
    return leaf + ptr


@case("lmdb")
def record_claims_4gb(c):
    db = c.copy_db()
    data = c.data_mdb(db)
    node = _node(data, _leaf(data), 5)
    struct.pack_into("<HH", data, node, 0xFFF0, 0xFFFF)
    c.save_mdb(db, data)
    return ["compute_image_mean", db], [db, "key '00000005'", "damaged LMDB", "4294967280 bytes"]


@case("lmdb")
def record_claims_64mb_data_layer(c):
    db = c.copy_db()
    data = c.data_mdb(db)
    node = _node(data, _leaf(data), 2)
    struct.pack_into("<HH", data, node, 0, 0x0400)        # 64 MiB: past the end of the file
    c.save_mdb(db, data)
    return time_args(_lmdb_net(c, db), "--iterations", "2"), [db, "layer 'data'", "key '00000002'",
                                                              "damaged LMDB", "67108864 bytes"]


@case("lmdb")
def record_overflow_page_past_the_end(c):
    db = c.copy_db()
    data = c.data_mdb(db)
    node = _node(data, _leaf(data), 7)
    ksize = struct.unpack_from("<H", data, node + 6)[0]
    struct.pack_into("<Q", data, node + 8 + ksize, 10**6)
    c.save_mdb(db, data)
    return ["compute_image_mean", db], [db, "damaged LMDB"]


@case("lmdb")
def zeroed_record(c):
    db = c.copy_db()
    data = c.data_mdb(db)
    node = _node(data, _leaf(data), 3)
    ksize = struct.unpack_from("<H", data, node + 6)[0]
    pgno = struct.unpack_from("<Q", data, node + 8 + ksize)[0]
    data[pgno * 4096 + 16:(pgno + 1) * 4096] = bytes(4096 - 16)
    c.save_mdb(db, data)
    return ["compute_image_mean", db], [db, "key '00000003'"]


@case("lmdb")
def record_not_a_datum(c):
    db = c.copy_db()
    put_raw(db, "00000004", b"\xff\xff\xff not a datum")
    return time_args(_lmdb_net(c, db), "--iterations", "2"), [db, "layer 'data'", "key '00000004'", "Datum"]


@case("lmdb")
def datum_wrong_byte_count(c):
    db = c.copy_db()
    datum = caffe_pb2.Datum(channels=3, height=32, width=32, data=bytes(100), label=1)
    put_raw(db, "00000006", datum.SerializeToString())
    return ["compute_image_mean", db], [db, "key '00000006'", "100 bytes"]


@case("lmdb")
def datum_negative_dims(c):
    db = c.copy_db()
    datum = caffe_pb2.Datum(channels=-1, height=-1, width=3, data=bytes(3), label=1)
    put_raw(db, "00000000", datum.SerializeToString())
    return time_args(_lmdb_net(c, db)), [db, "layer 'data'", "key '00000000'", "negative"]


@case("lmdb")
def datum_of_another_size(c):
    db = c.copy_db()
    datum = caffe_pb2.Datum(channels=3, height=16, width=16, data=bytes(768), label=1)
    put_raw(db, "00000002", datum.SerializeToString())
    return time_args(_lmdb_net(c, db), "--iterations", "2"), [db, "layer 'data'", "key '00000002'",
                                                              "3x16x16"]


@case("lmdb")
def datum_huge_declared_size(c):
    db = c.copy_db()
    datum = caffe_pb2.Datum(channels=2**31 - 1, height=2**31 - 1, width=2**31 - 1, label=1)
    put_raw(db, "00000000", datum.SerializeToString())
    return ["compute_image_mean", db], [db, "key '00000000'"]


@case("lmdb")
def encoded_datum_garbage(c):
    db = c.copy_db()
    datum = caffe_pb2.Datum(encoded=True, data=b"\x89PNG\r\n\x1a\n" + bytes(50), label=1)
    put_raw(db, "00000001", datum.SerializeToString())
    return ["compute_image_mean", db], [db, "key '00000001'", "decode"]


@case("lmdb")
def empty_lmdb(c):
    db = make_db(os.path.join(c.inp, "db"), 0)
    return time_args(_lmdb_net(c, db)), [db, "empty"]


@case("lmdb")
def missing_lmdb(c):
    db = os.path.join(c.inp, "nope_lmdb")
    return time_args(_lmdb_net(c, db)), [db, "layer 'data'", "data_param.source"]


@case("lmdb")
def file_as_lmdb(c):
    db = c.write("db", "not a database")
    return time_args(_lmdb_net(c, db)), [db, "layer 'data'", "not a database"]


@case("lmdb")
def damaged_leveldb(c):
    db = os.path.join(c.inp, "broken_leveldb")
    os.makedirs(db, exist_ok=True)
    with open(os.path.join(db, "CURRENT"), "w") as f:      # names a manifest that is not there
        f.write("MANIFEST-000009\n")
    return time_args(_lmdb_net(c, db)), [db, "layer 'data'", "damaged LevelDB"]


# =====================================================================================
# tools: the inputs of convert_imageset, compute_image_mean, split_db, upgrade_*, parse_log

def convert_args(c, *flags, listfile=None, db="out_lmdb"):
    return ["convert_imageset", *flags, c.fx.images, listfile or c.fx.list, db]


@case("tools")
def convert_missing_list(c):
    lst = os.path.join(c.inp, "nope.txt")
    return convert_args(c, listfile=lst), [lst]


@case("tools")
def convert_bad_list_line(c):
    lst = c.write("list.txt", "im0.png 0\nim1.png one\n")
    return convert_args(c, listfile=lst), [lst + ":2", "im1.png one"]


@case("tools")
def convert_check_size_mismatch(c):
    lst = c.write("list.txt", "im0.png 0\nim1.png 1\nwide.png 0\n")
    return convert_args(c, "--check_size", listfile=lst), ["out_lmdb", "wide.png", "--check_size"]


@case("tools", code=2)
def convert_huge_resize(c):
    return convert_args(c, "--resize_height", "1000000", "--resize_width", "1000000"), [
        "--resize_height", "1000000 x 1000000"]


@case("tools")
def convert_output_exists(c):
    os.makedirs(os.path.join(c.out, "out_lmdb"))
    return convert_args(c), ["out_lmdb", "already exists"]


@case("tools")
def convert_bad_encode_type(c):
    return convert_args(c, "--encoded", "--encode_type", "nosuchformat"), ["im0.png", "nosuchformat"]


@case("tools")
def convert_unwritable_output(c):
    return convert_args(c, db=os.path.join(c.inp, "no", "such", "dir", "out_lmdb")), ["out_lmdb"]


@case("tools")
def mean_of_empty_db(c):
    db = make_db(os.path.join(c.inp, "db"), 0)
    return ["compute_image_mean", db, "mean.binaryproto"], [db, "empty"]


@case("tools")
def mean_of_mixed_sizes(c):
    db = c.copy_db()
    datum = caffe_pb2.Datum(channels=3, height=8, width=8, data=bytes(192), label=1)
    put_raw(db, "00000009", datum.SerializeToString())
    return ["compute_image_mean", db, "mean.binaryproto"], [db, "key '00000009'", "3x8x8"]


@case("tools")
def mean_of_missing_db(c):
    db = os.path.join(c.inp, "nope")
    return ["compute_image_mean", db, "mean.binaryproto"], [db, "no such database"]


@case("tools")
def mean_into_missing_directory(c):
    out = os.path.join(c.inp, "no", "dir", "mean.binaryproto")
    return ["compute_image_mean", c.fx.db, out], [out, "cannot write"]


@case("tools")
def split_db_output_exists(c):
    os.makedirs(os.path.join(c.out, "shard_1"))
    return ["split_db", c.fx.db, "2", "shard"], ["shard_1", "already exists"]


@case("tools")
def split_db_missing_input(c):
    db = os.path.join(c.inp, "nope")
    return ["split_db", db, "2", "shard"], [db, "not found"]


@case("tools")
def upgrade_text_missing_input(c):
    p = os.path.join(c.inp, "nope.prototxt")
    return ["upgrade_net_proto_text", p, "new.prototxt"], [p, "cannot open"]


@case("tools")
def upgrade_text_syntax_error(c):
    p = _bad_net(c, DEPLOY + "layer {\n")
    return ["upgrade_net_proto_text", p, "new.prototxt"], [p + ":"]


@case("tools")
def upgrade_binary_garbage(c):
    w = c.write("w.caffemodel", os.urandom(2000))
    return ["upgrade_net_proto_binary", w, "new.caffemodel"], [w]


@case("tools")
def upgrade_binary_empty(c):
    w = c.write("w.caffemodel", b"")
    return ["upgrade_net_proto_binary", w, "new.caffemodel"], [w, "empty"]


@case("tools")
def upgrade_solver_syntax_error(c):
    p = c.write("solver.prototxt", "base_lr: x\n")
    return ["upgrade_solver_proto_text", p, "new.prototxt"], [p + ":", "base_lr"]


@case("tools")
def upgrade_solver_both_types(c):
    p = c.write("solver.prototxt", 'solver_type: SGD\ntype: "Adam"\n')
    return ["upgrade_solver_proto_text", p, "new.prototxt"], [p, "solver_type, type"]


@case("tools")
def parse_log_missing(c):
    p = os.path.join(c.inp, "nope.log")
    return ["parse_log", p, "out"], [p]


@case("tools")
def parse_log_bad_delimiter(c):
    return ["parse_log", c.fx.log, "out", "--delimiter", "::"], ["--delimiter", "::"]


@case("tools", code=2)
def test_without_weights(c):
    return ["test", "--model", c.fx.deploy], ["--weights"]


def categories():
    return sorted({c.category for c in CASES})
