"""The Python layer: user classes in the pycaffe shape, loaded by module and class name."""
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import caffepy
from caffepy.errors import LayerError
from layer_cases import TEST, TRAIN, Case, case_tests, make_layer, randn, setup_layer


class TimesTwo(caffepy.Layer):
    """y = 2x, written the way a pycaffe user writes a layer."""

    def setup(self, bottom, top):
        if len(bottom) != 1:
            raise Exception("TimesTwo takes one bottom")

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = 2 * top[0].diff


class LearnedScale(caffepy.Layer):
    """y = w * x + offset with w learned (self.blobs.add_blob) and offset from param_str."""

    def setup(self, bottom, top):
        self.offset = json.loads(self.param_str)["offset"]
        if len(self.blobs) == 0:
            self.blobs.add_blob(bottom[0].shape[1])
            self.blobs[0].data[...] = np.arange(1, bottom[0].shape[1] + 1)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data * self.blobs[0].data + self.offset

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[...] += (top[0].diff * bottom[0].data).sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff * self.blobs[0].data


class PhaseEcho(caffepy.Layer):
    """Outputs its phase (TRAIN 0, TEST 1) and param_str's length."""

    def reshape(self, bottom, top):
        top[0].reshape(2)

    def forward(self, bottom, top):
        top[0].data[...] = [self.phase, len(self.param_str)]


class NoForward(caffepy.Layer):
    def reshape(self, bottom, top):
        pass


class SetupOnly(caffepy.Layer):
    """pycaffe's ExceptionLayer: only setup, which refuses (param_str "raise") or not."""

    def setup(self, bottom, top):
        if self.param_str == "raise":
            raise RuntimeError("setup says no")
        top[0].reshape(*bottom[0].shape)


class NoReshape(caffepy.Layer):
    def setup(self, bottom, top):
        top[0].reshape(*bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data + 3


class NotALayer:
    pass


# The classes above, importable by name as a user's module would be.
USER = "caffepy_test_user_layers"
_module = types.ModuleType(USER)
for _cls in (TimesTwo, LearnedScale, PhaseEcho, NoForward, SetupOnly, NoReshape, NotALayer):
    setattr(_module, _cls.__name__, _cls)
sys.modules[USER] = _module


def py(layer, param_str=""):
    return f'python_param {{ module: "{USER}" layer: "{layer}" param_str: {json.dumps(param_str)} }}'


CASES = [
    Case("Python", py("TimesTwo"), [randn(2, 3, 4)], expected=lambda x: [2 * x]),
    Case("Python", py("LearnedScale", '{"offset": 0.5}'), [randn(4, 3)],
         expected=lambda x: [x * np.array([1, 2, 3]) + 0.5]),
]

test_forward, test_gradient = case_tests(CASES)


def test_user_layer_gets_phase_param_str_and_blobs():
    for phase in (TRAIN, TEST):
        layer, bottom, top = setup_layer("Python", py("PhaseEcho", "abc"), [randn(1)], phase=phase)
        layer.forward(bottom, top)
        np.testing.assert_array_equal(top[0].data, [phase, 3])
    layer, _, _ = setup_layer("Python", py("LearnedScale", '{"offset": 0}'), [randn(2, 5)])
    assert isinstance(layer, LearnedScale) and layer.blobs[0].shape == (5,)
    assert layer.type == "Python" and "Python" in repr(layer)


def test_module_found_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_layers_for_test.py").write_text(
        "import caffepy\n"
        "class AddOne(caffepy.Layer):\n"
        "    def reshape(self, bottom, top):\n"
        "        top[0].reshape(*bottom[0].shape)\n"
        "    def forward(self, bottom, top):\n"
        "        top[0].data[...] = bottom[0].data + 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "cwd_layers_for_test", raising=False)
    layer, bottom, top = setup_layer("Python", 'python_param { module: "cwd_layers_for_test" layer: "AddOne" }',
                                     [np.zeros(3, np.float32)])
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, [1, 1, 1])
    assert str(tmp_path) not in sys.path, "the current directory is only searched during the import"


def test_python_layer_in_a_net_trains_its_blob():
    from caffepy import upgrade
    text = f"""
    force_backward: true
    layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ dim: 2 dim: 3 }} }} }}
    layer {{ name: "py" type: "Python" bottom: "x" top: "y" {py("LearnedScale", '{"offset": 1}')} }}
    layer {{ name: "loss" type: "Reduction" bottom: "y" top: "loss" loss_weight: 1 }}
    """
    net = caffepy.Net(upgrade.parse_net_text(text), caffepy.TRAIN)
    x = randn(2, 3)
    net.blobs["x"].data[...] = x
    loss = net.forward_backward()
    assert loss == pytest.approx(float((x * [1, 2, 3]).sum() + 6), rel=1e-5)
    np.testing.assert_allclose(net.params["py"][0].diff, x.sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(net.blobs["x"].diff, np.tile([1, 2, 3], (2, 1)))


def one_layer_net(layer, param_str=""):
    from caffepy import upgrade
    return upgrade.parse_net_text(f"""
    layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ dim: 2 dim: 3 }} }} }}
    layer {{ name: "py" type: "Python" bottom: "x" top: "y" {py(layer, param_str)} }}
    """)


def test_a_layer_may_define_only_setup_and_its_exception_reaches_the_caller():
    with pytest.raises(RuntimeError) as info:
        caffepy.Net(one_layer_net("SetupOnly", "raise"), caffepy.TEST)
    assert type(info.value) is RuntimeError and str(info.value) == "setup says no"
    # the base class supplies the rest: reshape keeps the tops, backward does nothing
    net = caffepy.Net(one_layer_net("SetupOnly"), caffepy.TEST)
    assert isinstance(net.layers[1], SetupOnly) and net.blobs["y"].shape == (2, 3)
    net.layers[1].backward(net.top_vecs[1], [True], net.bottom_vecs[1])
    # a forward left out is reported when the net runs it, naming the layer and the class
    with pytest.raises(LayerError, match=rf"^<net>: layer 'py' \(Python\): python_param.layer: class must define "
                                         rf"forward\(bottom, top\), got 'SetupOnly' in '{USER}'$"):
        net.forward()
    with pytest.raises(LayerError, match=r"class must define forward\(bottom, top\), got 'NoForward'"):
        caffepy.Net(one_layer_net("NoForward"), caffepy.TEST).forward()


def test_a_layer_without_reshape_keeps_the_shapes_setup_gave():
    net = caffepy.Net(one_layer_net("NoReshape"), caffepy.TEST)
    out = net.forward(x=np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(out["y"], np.full((2, 3), 4.0))
    assert type(net.layers[1]).__name__ == "NoReshape" and isinstance(net.layers[1], NoReshape)


@pytest.mark.parametrize("params,pattern", [
    ('python_param { module: "no_such_module_xyz" layer: "A" }',
     r"python_param.module: cannot import module, got 'no_such_module_xyz'\. Put no_such_module_xyz.py in "
     r"the current directory"),
    (f'python_param {{ module: "{USER}" layer: "Missing" }}',
     rf"python_param.layer: module '{USER}' has no class, got 'Missing'\. Layer classes there: "
     r"LearnedScale, NoForward, NoReshape, PhaseEcho, SetupOnly, TimesTwo"),
    (f'python_param {{ module: "{USER}" layer: "NotALayer" }}',
     r"python_param.layer: must name a subclass of caffepy.Layer"),
    ('python_param { layer: "A" }', r"python_param.module: is required"),
])
def test_load_errors_are_one_line_and_name_the_layer(params, pattern):
    with pytest.raises(LayerError, match=r"^layer 'layer' \(Python\): " + pattern) as info:
        make_layer("Python", params)
    assert "\n" not in str(info.value)


def test_an_error_inside_the_users_module_is_reported(tmp_path, monkeypatch):
    (tmp_path / "broken_layers_for_test.py").write_text("import numpy\nraise ValueError('bad\\nconfig')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LayerError, match=r"importing 'broken_layers_for_test' failed, got ValueError: bad config$"):
        make_layer("Python", 'python_param { module: "broken_layers_for_test" layer: "A" }')


# py-faster-rcnn's shape of a layer: `import caffe`, param_str_, str(self.phase) as a key,
# tops sized in setup and resized in forward, an empty reshape
FASTER_RCNN_STYLE = """
import caffe
import numpy as np

SETTINGS = {'TRAIN': {'N': 3}, 'TEST': {'N': 1}}


class Proposals(caffe.Layer):
    def setup(self, bottom, top):
        self._value = float(self.param_str_)
        top[0].reshape(1, 5)

    def forward(self, bottom, top):
        n = SETTINGS[str(self.phase)]['N']
        top[0].reshape(n, 5)
        top[0].data[...] = self._value

    def backward(self, top, propagate_down, bottom):
        pass

    def reshape(self, bottom, top):
        pass


def _check(anchors):
    if anchors < 0:
        raise ValueError('negative anchors: %d' % anchors)


class Fails(caffe.Layer):
    def setup(self, bottom, top):
        if self.param_str == 'setup':
            _check(-1)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        _check(-2)
"""

STYLE_NET = """
layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ dim: 2 dim: 3 }} }} }}
layer {{ name: "py" type: "Python" bottom: "x" top: "y"
         python_param {{ module: "faster_rcnn_style_layers" layer: "{layer}" param_str: "{param_str}" }} }}
{tail}"""


def _style_net(layer, param_str, tail=""):
    from caffepy import upgrade
    return upgrade.parse_net_text(STYLE_NET.format(layer=layer, param_str=param_str, tail=tail))


@pytest.fixture
def style_module(tmp_path, monkeypatch):
    (tmp_path / "faster_rcnn_style_layers.py").write_text(FASTER_RCNN_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "faster_rcnn_style_layers", raising=False)
    return tmp_path / "faster_rcnn_style_layers.py"


def test_a_pycaffe_layer_module_runs_unchanged(style_module):
    tail = 'layer { name: "scale" type: "Power" bottom: "y" top: "z" power_param { scale: 2 } }'
    for phase, rows in ((caffepy.TRAIN, 3), (caffepy.TEST, 1)):
        net = caffepy.Net(_style_net("Proposals", "1.5", tail), phase)
        out = net.forward()
        # resized in forward: the next layer's reshape sees the new shape
        assert out["z"].shape == (rows, 5) and np.all(out["z"] == 3.0)
    import caffe
    assert caffe is caffepy and isinstance(net.layers[1], caffe.Layer)
    assert net.layers[1].param_str_ == net.layers[1].param_str == "1.5"
    assert str(net.layers[1].phase) == "TEST" and net.layers[1].phase == caffepy.TEST == 1


def test_a_python_layers_own_exception_keeps_its_type_and_traceback(style_module):
    from caffepy.errors import python_layer_report
    net = caffepy.Net(_style_net("Fails", ""), caffepy.TEST)
    with pytest.raises(ValueError) as info:
        net.forward()
    assert str(info.value) == "negative anchors: -2"
    lines = python_layer_report(info.value).splitlines()
    assert lines[0] == ("<net>: layer 'py' (Python faster_rcnn_style_layers.Fails): forward: raised ValueError "
                        "(the traceback of the layer's code follows)")
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "ValueError: negative anchors: -2"
    # the user's frames only: forward, then the helper it called
    files = [line for line in lines if line.startswith("  File ")]
    assert len(files) == 2 and all(str(style_module) in f for f in files)
    assert files[0].endswith("in forward") and files[1].endswith("in _check")
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == ["(raised in <net>: layer 'py' (Python faster_rcnn_style_layers.Fails): "
                                        "forward)"]
    # a ValueError from the user's setup is the user's too, not a caffepy shape error
    with pytest.raises(ValueError) as info:
        caffepy.Net(_style_net("Fails", "setup"), caffepy.TEST)
    assert str(info.value) == "negative anchors: -1"


def test_the_command_line_prints_the_layers_name_then_its_traceback(tmp_path):
    from paths import REPO
    (tmp_path / "faster_rcnn_style_layers.py").write_text(FASTER_RCNN_STYLE)
    model = tmp_path / "net.prototxt"
    model.write_text(STYLE_NET.format(layer="Fails", param_str="", tail=""))
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "caffepy.cli", "time", "-model", str(model), "-iterations", "1"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr[proc.stderr.index("caffepy: error: "):].splitlines()
    assert err[0] == (f"caffepy: error: {model}: layer 'py' (Python faster_rcnn_style_layers.Fails): forward: "
                      f"raised ValueError (the traceback of the layer's code follows)")
    assert err[1] == "Traceback (most recent call last):" and err[-1] == "ValueError: negative anchors: -2"
    assert "caffepy" not in "".join(line for line in err[1:] if line.startswith("  File "))


def _run_python(code, pythonpath, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd)


IMPORTS = """
import caffe, caffepy
from caffe.proto import caffe_pb2
import caffe.io, caffe.draw, caffe.net_spec
from caffe import layers as L, params as P
import caffepy.proto.caffe_pb2 as ours
assert caffe is caffepy and caffe_pb2 is ours and caffe.io is caffepy.io
assert caffe.Layer is caffepy.Layer and str(caffe.TRAIN) == 'TRAIN' and L is caffepy.layers
try:
    import caffe.no_such_module
except ModuleNotFoundError as e:
    print(e)
"""


def test_import_caffe_is_caffepy(tmp_path):
    from paths import REPO
    proc = _run_python(IMPORTS, [REPO], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "No module named 'caffe.no_such_module'\n"


# a stand-in for a Caffe build's python/ directory
REAL_CAFFE = "class Layer(object):\n    pass\nTRAIN, TEST = 0, 1\n"
LOADS_A_LAYER = """
import caffepy
from caffepy import upgrade
text = '''
layer { name: 'in' type: 'Input' top: 'x' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'py' type: 'Python' bottom: 'x' top: 'y'
        python_param { module: 'faster_rcnn_style_layers' layer: 'Proposals' param_str: '2' } }
'''
net = caffepy.Net(upgrade.parse_net_text(text), caffepy.TRAIN)
print(net.forward()['y'].sum())
"""


@pytest.mark.parametrize("first", ["", "import caffe\n"], ids=["caffepy-takes-the-name", "real-caffe-imported-first"])
def test_a_real_caffe_on_the_path(tmp_path, first):
    from paths import REPO
    real = tmp_path / "real" / "caffe"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text(REAL_CAFFE)
    (tmp_path / "faster_rcnn_style_layers.py").write_text(FASTER_RCNN_STYLE)
    # the real Caffe first on the path, as PYTHONPATH=/opt/caffe/python puts it
    proc = _run_python(first + LOADS_A_LAYER, [str(tmp_path / "real"), str(tmp_path), REPO], tmp_path)
    if not first:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "30.0\n"
        assert (f"a Caffe is on the Python path ({real}); Python layers run by caffepy get caffepy as `caffe`"
                in proc.stderr)
    else:
        assert proc.returncode == 1
        assert (f"python_param.layer: subclasses the caffe.Layer of another Caffe ({real / '__init__.py'}, "
                f"imported before caffepy loaded this layer), which caffepy cannot run, got 'Proposals' in "
                f"'faster_rcnn_style_layers'. Import caffepy's `caffe` instead") in proc.stderr
