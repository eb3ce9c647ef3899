"""caffe.proto: Caffe's numbers, the generated module in sync, real files parse."""
import glob
import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from caffepy.proto import caffe_pb2

from paths import REPO
PROTO = os.path.join(REPO, "caffepy", "proto", "caffe.proto")
REFERENCE = os.path.join(REPO, "..", "shared", "reference-models")
REFERENCE_FILES = sorted(glob.glob(os.path.join(REFERENCE, "*", "*.prototxt")))


def number(message, field):
    return getattr(caffe_pb2, message).DESCRIPTOR.fields_by_name[field].number


# (message, field, number) as Caffe has them: the binary format depends on each.
CAFFE_NUMBERS = [
    ("BlobShape", "dim", 1), ("BlobProto", "shape", 7), ("BlobProto", "data", 5),
    ("BlobProto", "diff", 6), ("BlobProto", "double_data", 8), ("BlobProto", "double_diff", 9),
    ("BlobProto", "num", 1), ("BlobProto", "width", 4), ("BlobProtoVector", "blobs", 1),
    ("Datum", "data", 4), ("Datum", "label", 5), ("Datum", "float_data", 6), ("Datum", "encoded", 7),
    ("NetParameter", "name", 1), ("NetParameter", "layers", 2), ("NetParameter", "input", 3),
    ("NetParameter", "input_dim", 4), ("NetParameter", "input_shape", 8), ("NetParameter", "state", 6),
    ("NetParameter", "layer", 100),
    ("SolverParameter", "net", 24), ("SolverParameter", "net_param", 25), ("SolverParameter", "train_net", 1),
    ("SolverParameter", "test_net", 2), ("SolverParameter", "train_state", 26),
    ("SolverParameter", "test_iter", 3), ("SolverParameter", "base_lr", 5), ("SolverParameter", "iter_size", 36),
    ("SolverParameter", "stepvalue", 34), ("SolverParameter", "clip_gradients", 35),
    ("SolverParameter", "snapshot_format", 37), ("SolverParameter", "rms_decay", 38),
    ("SolverParameter", "momentum2", 39), ("SolverParameter", "type", 40), ("SolverParameter", "delta", 31),
    ("SolverParameter", "solver_type", 30), ("SolverParameter", "regularization_type", 29),
    ("SolverParameter", "layer_wise_reduce", 41), ("SolverParameter", "weights", 42),
    ("SolverParameter", "warmup_iter", 48), ("SolverParameter", "warmup_start_lr", 49),
    ("SolverParameter", "local_lr_auto", 50), ("SolverParameter", "local_gw_ratio", 51),
    ("SolverState", "iter", 1), ("SolverState", "history", 3), ("SolverState", "current_step", 4),
    ("NetState", "stage", 3), ("NetStateRule", "not_stage", 5), ("ParamSpec", "decay_mult", 4),
    ("LayerParameter", "param", 6), ("LayerParameter", "blobs", 7), ("LayerParameter", "include", 8),
    ("LayerParameter", "phase", 10), ("LayerParameter", "propagate_down", 11),
    ("LayerParameter", "transform_param", 100), ("LayerParameter", "loss_param", 101),
    ("LayerParameter", "convolution_param", 106), ("LayerParameter", "batch_norm_param", 139),
    ("LayerParameter", "input_param", 143), ("LayerParameter", "recurrent_param", 146),
    ("LayerParameter", "swish_param", 147), ("LayerParameter", "clip_param", 148),
    ("LayerParameter", "engine", 149), ("LayerParameter", "multinode", 150),
    ("ConvolutionParameter", "stride", 6), ("ConvolutionParameter", "dilation", 18),
    ("ConvolutionParameter", "engine", 15), ("PoolingParameter", "pad", 4),
    ("PoolingParameter", "kernel_size", 2), ("PoolingParameter", "stride", 3),
    ("PoolingParameter", "round_mode", 13), ("DataParameter", "backend", 8), ("DataParameter", "shuffle", 11),
    ("ConcatParameter", "axis", 2), ("SliceParameter", "axis", 3), ("InfogainLossParameter", "axis", 2),
    ("V1LayerParameter", "type", 5), ("V1LayerParameter", "blobs_lr", 7), ("V1LayerParameter", "param", 1001),
    ("V1LayerParameter", "layer", 1), ("V0LayerParameter", "kernelsize", 8),
    ("V0LayerParameter", "hdf5_output_param", 1001),
    # Intel Caffe's, where BVLC leaves the number free
    ("SolverParameter", "test_offset", 52), ("SolverParameter", "stagelr", 150),
    ("SolverParameter", "stageiter", 151), ("CompileNetState", "negative_conv_names", 5),
    ("CompileNetState", "negative_conv_indexes", 6), ("LayerParameter", "quantization_param", 158),
    ("LayerParameter", "reorg_param", 159), ("LayerParameter", "split_param", 208),
    ("LayerParameter", "region_loss_param", 209), ("LayerParameter", "eval_detection_param", 301),
    ("LayerParameter", "roi_pooling_param", 154), ("QuantizationParameter", "is_negative_input", 23),
    ("QuantizationParameter", "force_u8_input", 24), ("TransformationParameter", "bgr2rgb", 18),
    ("TransformationParameter", "pad", 19), ("ConcatParameter", "per_fla_fuse", 4),
    ("ConvolutionParameter", "coeff", 23), ("ConvolutionParameter", "fusion_type", 24),
    ("DataParameter", "side", 12), ("InnerProductParameter", "relu", 8),
    ("InnerProductParameter", "negative_slope", 9), ("PoolingParameter", "pad_3d", 15),
    ("PoolingParameter", "kernel_size_3d", 16), ("PoolingParameter", "stride_3d", 17),
    ("ReshapeParameter", "pixelshuffler", 4), ("ReorgParameter", "stride", 1), ("ReorgParameter", "reverse", 2),
    ("RegionLossParameter", "biases", 16), ("RegionLossParameter", "class_map", 18),
    ("EvalDetectionParameter", "score_type", 7), ("EvalDetectionParameter", "biases", 9),
]


@pytest.mark.parametrize("message,field,expected", CAFFE_NUMBERS)
def test_field_numbers_are_caffes(message, field, expected):
    assert number(message, field) == expected


def test_enum_values_are_caffes():
    assert caffe_pb2.ConvolutionParameter.SUM_FUSION == 1
    assert caffe_pb2.EvalDetectionParameter.MULTIPLY == 2
    assert caffe_pb2.V1LayerParameter.CONVOLUTION == 4
    assert caffe_pb2.V1LayerParameter.SOFTMAX_LOSS == 21
    assert caffe_pb2.V1LayerParameter.DECONVOLUTION == 39
    assert caffe_pb2.SolverParameter.ADAM == 5
    assert caffe_pb2.LossParameter.NONE == 3
    assert caffe_pb2.DataParameter.LMDB == 1
    assert caffe_pb2.TRAIN == 0 and caffe_pb2.TEST == 1


def test_numbers_are_unique_per_message():
    # protoc already refuses duplicates; this guards hand edits of the proto
    # that rename a field onto a number Caffe gives another meaning.
    for message in caffe_pb2.DESCRIPTOR.message_types_by_name.values():
        numbers = [f.number for f in message.fields]
        assert len(numbers) == len(set(numbers)), message.name


def _protoc(out_dir):
    protoc = pytest.importorskip("grpc_tools.protoc")
    status = protoc.main(["protoc", f"-I{os.path.dirname(PROTO)}", f"--python_out={out_dir}", PROTO])
    assert status == 0


def _gencode_version(text):
    for line in text.splitlines():
        if line.startswith("# Protobuf Python Version:"):
            return line.split(":", 1)[1].strip()
    return None


def test_generated_module_matches_proto(tmp_path):
    _protoc(tmp_path)
    fresh = (tmp_path / "caffe_pb2.py").read_text()
    committed = open(os.path.join(REPO, "caffepy", "proto", "caffe_pb2.py")).read()
    if _gencode_version(fresh) != _gencode_version(committed):
        pytest.skip(f"installed grpc_tools generates for protobuf {_gencode_version(fresh)}, "
                    f"the committed module is for {_gencode_version(committed)}")
    assert fresh == committed, "caffe_pb2.py is stale: run `make proto`"


@pytest.mark.skipif(not REFERENCE_FILES, reason="no reference models next to the repository")
@pytest.mark.parametrize("path", REFERENCE_FILES, ids=os.path.basename)
def test_reference_file_parses_with_plain_text_format(path):
    msg = caffe_pb2.SolverParameter() if "solver" in os.path.basename(path) else caffe_pb2.NetParameter()
    text_format.Parse(open(path).read(), msg)
    assert msg.ListFields()


def test_caffemodel_reads_with_a_separately_generated_module(tmp_path):
    """Our writer's bytes mean the same to an independent build of the schema."""
    from caffepy.blobproto import array_to_blobproto
    from caffepy.prototxt import write_binary

    rng = np.random.default_rng(3)
    weights = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    net = caffe_pb2.NetParameter(name="tiny")
    layer = net.layer.add(name="conv1", type="Convolution")
    layer.convolution_param.num_output = 4
    layer.convolution_param.kernel_size.append(5)
    layer.blobs.append(array_to_blobproto(weights))
    layer.blobs.append(array_to_blobproto(bias))
    path = tmp_path / "tiny.caffemodel"
    write_binary(net, path)

    gen = tmp_path / "gen"
    gen.mkdir()
    _protoc(gen)
    code = (
        "import sys, numpy as np\n"
        f"sys.path.insert(0, {str(gen)!r})\n"
        "import caffe_pb2\n"
        "net = caffe_pb2.NetParameter()\n"
        f"net.ParseFromString(open({str(path)!r}, 'rb').read())\n"
        "layer = net.layer[0]\n"
        "for bp in layer.blobs:\n"
        "    print(list(bp.shape.dim), np.array(bp.data, dtype=np.float32).tobytes().hex())\n"
    )
    # A fresh interpreter: two modules registering caffe.proto cannot share one pool.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.split()
    assert lines[0:4] == ["[4,", "3,", "5,", "5]"]
    assert lines[4] == weights.tobytes().hex()
    assert lines[5] == "[4]" and lines[6] == bias.tobytes().hex()


def test_pycaffe_import_path():
    module = importlib.import_module("caffepy.proto.caffe_pb2")
    assert module.NetParameter is caffe_pb2.NetParameter
