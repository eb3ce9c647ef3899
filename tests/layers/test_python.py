"""The Python layer: user classes in the pycaffe shape, loaded by module and class name."""
import json
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


def test_a_pycaffe_import_gets_a_hint(tmp_path, monkeypatch):
    (tmp_path / "pycaffe_layers_for_test.py").write_text("import caffe\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LayerError, match=r"No module named 'caffe'\. caffepy is pycaffe's API: write "
                                         r"`import caffepy as caffe`$"):
        make_layer("Python", 'python_param { module: "pycaffe_layers_for_test" layer: "A" }')
