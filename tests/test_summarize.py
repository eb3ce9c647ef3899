"""caffepy summarize: Caffe's tools/extra/summarize.py columns, then shapes, parameters, FLOPs
and memory counted by hand."""
from click.testing import CliRunner

from caffepy import summarize
from caffepy.cli import main

NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  param { lr_mult: 1 } param { name: "b" lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "up" type: "Deconvolution" bottom: "pool" top: "up"
  convolution_param { num_output: 6 kernel_size: 2 stride: 2 group: 2 bias_term: false } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc" inner_product_param { num_output: 5 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" loss_weight: 1 }
layer { name: "train_only" type: "ReLU" bottom: "fc" top: "t" include { phase: TRAIN } }
"""


def write(tmp_path, text=NET):
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    return str(path)


def test_rows_count_shapes_parameters_flops_and_memory(tmp_path, capsys):
    table, totals = summarize.summarize(write(tmp_path))
    rows = {row[0]: row for row in table}
    assert list(rows) == ["data", "conv", "relu", "pool", "up", "fc", "prob"]       # TEST's layers
    # BVLC's columns: name, type, param specs, bottoms, ->, tops (loss weight), window
    assert rows["conv"][:7] == ["conv", "Convolution", "(, b x2 Dx0)", "data", "->", "conv", "3+1 4"]
    assert rows["pool"][6] == "2/2" and rows["up"][6] == "2/2 6/2" and rows["prob"][5] == "1 * prob"
    # conv: 2x4x8x8 = 512 outputs of 3*3*3 multiply-adds, plus a bias each
    assert rows["conv"][7:] == ["2x4x8x8", "112", "28.2k", "2.0 KiB"]
    assert rows["relu"][7:] == ["2x4x8x8", "", "512", ""]                # in place: no memory
    assert rows["pool"][7:] == ["2x4x4x4", "", "512", "512 bytes"]       # 128 outputs of 4
    # deconvolution: 128 inputs, each spread over (6 / 2 groups) x 2 x 2 outputs; no bias
    assert rows["up"][7:] == ["2x6x8x8", "48", "3.07k", "3.0 KiB"]
    assert rows["fc"][7:] == ["2x5", "325", "1.29k", "40 bytes"]         # 2 * 2 * 64 * 5 + 10
    assert rows["prob"][7:] == ["2x5", "", "10", "40 bytes"]
    assert totals == dict(parameters=112 + 48 + 325, parameter_bytes=4 * (112 + 48 + 325),
                          flops=28160 + 512 + 512 + 3072 + 1290 + 10, activations=4 * (384 + 512 + 128 + 768 + 10 + 10))
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "type", "params", "bottoms", "tops", "window", "top", "shape", "parameters",
                              "FLOPs", "memory"]
    assert out[2].split() == ["conv", "Convolution", "(,", "b", "x2", "Dx0)", "data", "->", "conv", "3+1", "4",
                              "2x4x8x8", "112", "28.2k", "2.0", "KiB"]
    assert out[-1] == ("Total: 7 layers, 485 parameters (1.9 KiB), 3.36e-05 GFLOPs forward for a batch of 2, "
                       "7.1 KiB of activations (training also keeps a diff of each blob and parameter)")


def test_column_widths_follow_bvlcs_layout():
    # as narrow as the widest cell + 1, capped at max_width; a long cell pushes the rest right
    lines = summarize.format_table([["a", "bb", "c"], ["long_name", "x", "y"]], max_width=5)
    assert lines == ["a    bb c", "long_name x y"]


def test_a_net_that_cannot_be_built_gets_bvlcs_columns(tmp_path, capsys):
    net = write(tmp_path, 'layer { name: "d" type: "Data" top: "data" top: "label" '
                          'data_param { source: "missing_lmdb" batch_size: 4 } }\n' + NET.split("\n", 3)[3])
    table, _ = summarize.summarize(net, phase="TRAIN")
    assert [row[0] for row in table] == ["d", "conv", "relu", "pool", "up", "fc", "prob", "train_only"]
    assert all(len(row) == 7 for row in table)
    assert table[1][6] == "3+1 4"        # from the prototxt alone
    assert capsys.readouterr().out.splitlines()[0].split() == ["name", "type", "params", "bottoms", "tops", "window"]


def test_command_takes_bvlcs_flags(tmp_path):
    result = CliRunner().invoke(main, ["summarize", "-w", "4", write(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[2].startswith("conv Convolution (, b x2 Dx0) data -> conv 3+1 4")
    assert "\033[" not in result.output          # colours only on a terminal
    result = CliRunner().invoke(main, ["summarize", "--max-width=4", "--phase", "TRAIN", write(tmp_path)])
    assert result.exit_code == 0 and "train_only" in result.output


def test_colours_on_a_terminal_mark_unread_tops_and_unwritten_bottoms():
    from caffepy.proto import caffe_pb2
    from google.protobuf import text_format
    param = text_format.Parse('layer { name: "a" type: "ReLU" bottom: "nowhere" top: "x" } '
                              'layer { name: "b" type: "ReLU" bottom: "x" top: "y" }', caffe_pb2.NetParameter())
    table, _ = summarize.summarize_net(param, None, color=True)
    assert table[0][3] == "\033[41mnowhere\033[0m"               # no layer wrote it
    assert table[0][5] == "\033[92mx\033[0m" and table[1][3] == "\033[92mx\033[0m"   # one colour per blob
    assert table[1][5] == "\033[93m\033[1;4my\033[0m"          # no layer reads it
    assert summarize.printed_len(table[1][5]) == 1
