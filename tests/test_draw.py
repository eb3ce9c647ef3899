"""caffe.draw and `caffepy draw_net`: the DOT text (labels, colours, rank direction, phases)
checked without Graphviz; drawing to PNG/SVG/PDF where Graphviz's `dot` is installed."""
import builtins
import shutil

import pytest
from click.testing import CliRunner
from google.protobuf import text_format

import caffepy as caffe
from caffepy import draw
from caffepy.cli import main
from caffepy.errors import CaffepyError, LayerError
from caffepy.proto import caffe_pb2

NET = """
name: "LeNetish"
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  data_param { source: "train_lmdb" batch_size: 64 backend: LMDB } }
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TEST }
  data_param { source: "test_lmdb" batch_size: 100 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  convolution_param { num_output: 20 kernel_size: 5 stride: 1 } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1" inner_product_param { num_output: 500 } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "accuracy" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""

DOT = shutil.which("dot")
needs_dot = pytest.mark.skipif(DOT is None, reason="Graphviz's dot is not installed (apt-get install graphviz)")


def net():
    p = caffe_pb2.NetParameter()
    text_format.Parse(NET, p)
    return p


def node_lines(dot_text):
    return [line for line in dot_text.splitlines() if line.startswith('"layer') and " -> " not in line]


def test_dot_text_labels_colours_and_edges():
    text = draw.to_dot(net())
    lines = text.splitlines()
    assert lines[0] == 'digraph "LeNetish" {' and lines[1] == "rankdir=LR;" and lines[-1] == "}"
    nodes = node_lines(text)
    assert len(nodes) == 8                          # every layer: phase None draws all
    conv = next(line for line in nodes if "conv1" in line)
    # Caffe's label: name, (Type), kernel/stride/pad, one per line in a horizontal layout
    assert r'label="conv1\n(Convolution)\nkernel size: 5\nstride: 1\npad: 0"' in conv
    assert 'shape="record"' in conv and 'fillcolor="#FF5050"' in conv and 'style="filled"' in conv
    pool = next(line for line in nodes if "pool1" in line)
    assert r'label="pool1\n(Pooling MAX)\nkernel size: 2\nstride: 2\npad: 0"' in pool
    assert 'fillcolor="#FF9900"' in pool
    assert 'fillcolor="#CC33FF"' in next(line for line in nodes if "ip1" in line and "ReLU" not in line)
    # an in-place layer is green; other layers default blue
    assert 'fillcolor="#90EE90"' in next(line for line in nodes if "(ReLU)" in line)
    assert 'fillcolor="#6495ED"' in next(line for line in nodes if "(SoftmaxWithLoss)" in line)
    # blobs are grey octagons; edges out of Data say the batch, out of learned layers num_output
    assert '"blob_conv1" [shape="octagon", fillcolor="#E0E0E0", style="filled", label="conv1"];' in lines
    assert '"layer0" -> "blob_data" [label="Batch 64"];' in lines
    assert '"layer1" -> "blob_data" [label="Batch 100"];' in lines
    assert '"layer2" -> "blob_conv1" [label="20"];' in lines
    assert '"layer4" -> "blob_ip1" [label="500"];' in lines
    assert '"blob_data" -> "layer2" [label=""];' in lines
    assert '"layer3" -> "blob_pool1" [label=""];' in lines
    no_labels = draw.to_dot(net(), label_edges=False)
    assert '"layer2" -> "blob_conv1" [label=""];' in no_labels.splitlines()


def test_rank_direction_changes_the_label_separator():
    for rankdir in ("TB", "BT"):
        text = draw.to_dot(net(), rankdir)
        assert f"rankdir={rankdir};" in text
        assert 'label="conv1 (Convolution) kernel size: 5 stride: 1 pad: 0"' in text
    assert r'label="conv1\n(Convolution)' in draw.to_dot(net(), "RL")
    with pytest.raises(CaffepyError, match="rankdir: must be one of LR, TB, BT, RL, got 'XY'"):
        draw.to_dot(net(), "XY")


def test_phase_filtering():
    train = node_lines(draw.to_dot(net(), phase=caffe.TRAIN))
    test = node_lines(draw.to_dot(net(), phase=caffe.TEST))
    assert len(train) == 6 and not any("accuracy" in line for line in train)
    assert len(test) == 7 and any("accuracy" in line for line in test)
    assert "Batch 64" in draw.to_dot(net(), phase=caffe.TRAIN)
    assert "Batch 64" not in draw.to_dot(net(), phase=caffe.TEST)
    p = net()
    p.layer[2].exclude.add(phase=caffe.TRAIN)
    assert not any("conv1" in line for line in node_lines(draw.to_dot(p, phase=caffe.TRAIN)))
    assert any("conv1" in line for line in node_lines(draw.to_dot(p, phase=caffe.TEST)))
    p.layer[0].exclude.add(phase=caffe.TEST)
    with pytest.raises(LayerError, match="layer 'mnist' \\(Data\\): include: a layer cannot have both"):
        draw.to_dot(p, phase=caffe.TRAIN)


def test_display_lrm_and_special_characters():
    assert "lr mult: 1.0, 2.0" in draw.to_dot(net(), display_lrm=True)
    assert "lr mult" not in draw.to_dot(net())
    assert draw.get_layer_lr_mult(net().layer[4]) == (1.0, 1.0)
    p = net()
    p.layer[2].name = 'a{b}|c<d>"e'
    text = draw.to_dot(p)
    assert r'label="a\{b\}\|c\<d\>\"e\n(Convolution)' in text


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # pydot's own use of pyparsing
def test_get_pydot_graph_parses_the_dot_text():
    pydot = pytest.importorskip("pydot")
    graph = draw.get_pydot_graph(net(), "TB", phase=caffe.TEST)
    assert isinstance(graph, pydot.Dot)
    assert graph.get_rankdir() == "TB"
    layer_nodes = [n for n in graph.get_nodes() if n.get_name().startswith('"layer')]
    assert len(layer_nodes) == 7
    assert len(graph.get_edges()) == 16


def test_get_pydot_graph_without_pydot_says_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_pydot(name, *args, **kwargs):
        if name == "pydot":
            raise ImportError("No module named 'pydot'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pydot)
    with pytest.raises(CaffepyError, match=r"get_pydot_graph needs pydot, which is not installed. Install it "
                                           r"with: pip install pydot \(or pip install 'caffepy\[draw\]'\)"):
        draw.get_pydot_graph(net(), "LR")


def test_raw_output_needs_no_graphviz(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))         # no dot anywhere
    out = tmp_path / "net.raw"
    draw.draw_net_to_file(net(), str(out), "LR", caffe.TRAIN)
    assert out.read_text() == draw.to_dot(net(), "LR", phase=caffe.TRAIN)
    with pytest.raises(CaffepyError, match=r"needs Graphviz's `dot` program, which is not on PATH. Install "
                                           r"Graphviz \(Debian/Ubuntu: apt-get install graphviz\)"):
        draw.draw_net_to_file(net(), str(tmp_path / "net.png"))
    with pytest.raises(CaffepyError, match="needs an extension"):
        draw.draw_net_to_file(net(), str(tmp_path / "net"))


@needs_dot
@pytest.mark.parametrize("ext, magic", [("png", b"\x89PNG\r\n\x1a\n"), ("svg", b"<svg"), ("pdf", b"%PDF")])
def test_draw_net_to_file_renders_through_dot(tmp_path, ext, magic):
    out = tmp_path / f"net.{ext}"
    draw.draw_net_to_file(net(), str(out), "TB", caffe.TEST)
    data = out.read_bytes()
    assert magic in data[:400]
    if ext == "svg":
        text = data.decode()
        assert "conv1" in text and "(Pooling MAX)" in text and "#ff5050" in text.lower()
        assert "accuracy" in text


@needs_dot
def test_draw_net_reports_dots_refusal():
    with pytest.raises(CaffepyError, match="draw: dot -Tnosuchformat failed: .*nosuchformat"):
        draw.draw_net(net(), "LR", ext="nosuchformat")


def caffepy(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_draw_net(tmp_path, monkeypatch):
    proto = tmp_path / "net.prototxt"
    proto.write_text(NET)
    out = tmp_path / "net.raw"
    result = caffepy("draw_net", proto, out, "--rankdir", "TB", "--phase", "TEST")
    assert result.exit_code == 0, result.output
    assert result.output == f"Drawing net to {out}\n"
    assert out.read_text() == draw.to_dot(net(), "TB", phase=caffe.TEST)
    # Caffe's flag spellings work too
    result = caffepy("draw_net", proto, out, "-rankdir=BT", "-phase=TRAIN", "-display_lrm=true")
    assert result.exit_code == 0, result.output
    assert out.read_text() == draw.to_dot(net(), "BT", phase=caffe.TRAIN, display_lrm=True)
    assert caffepy("draw_net", proto, out, "--rankdir", "XY").exit_code == 2
    # without dot: one line naming what to install, exit 1
    monkeypatch.setenv("PATH", str(tmp_path))
    result = caffepy("draw_net", proto, tmp_path / "n.png")
    assert result.exit_code == 1
    assert result.output.splitlines()[-1].startswith("caffepy: error: draw: drawing a .png needs Graphviz")


@needs_dot
def test_cli_draw_net_writes_a_png(tmp_path):
    proto = tmp_path / "net.prototxt"
    proto.write_text(NET)
    out = tmp_path / "net.png"
    result = caffepy("draw_net", proto, out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
