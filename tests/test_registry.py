"""The registry and the factory: every registered implementation (variant) of a layer with a
gradient has a gradient case; registration refuses duplicates; the factory's choices."""
import glob
import importlib.util
import os
import sys

import pytest

from caffepy.context import RunContext
from caffepy.errors import LayerError, ParallelError
from caffepy.layer import BLOCKED, LAYERS, MODEL_PARALLEL, NHWC, PLAIN, VIA_NCHW, Layer, create_layer, register
from caffepy.precision import BF16, BF16_NHWC
from layer_cases import layer_param


def _loaded(path):
    """The module pytest already imported from `path`: running a test module twice would
    define its classes twice and break its own isinstance checks."""
    for module in list(sys.modules.values()):
        if os.path.abspath(getattr(module, "__file__", None) or "") == os.path.abspath(path):
            return module
    return None


def _all_cases():
    cases = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "layers", "test_*.py"))):
        module = _loaded(path)
        if module is None:
            spec = importlib.util.spec_from_file_location(f"_cases_{os.path.basename(path)[:-3]}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        cases += getattr(module, "CASES", [])
    return cases


def test_every_variant_of_a_differentiable_layer_has_a_gradient_case():
    covered = {(c.type, c.variant) for c in _all_cases() if c.grad}
    missing = sorted(f"{name} ({variant})" for name, variants in LAYERS.items()
                     for variant, cls in variants.items()
                     if cls.differentiable and (name, variant) not in covered)
    assert not missing, f"layer variants without a gradient case: {missing}"


def test_the_variants_are_registered():
    assert set(LAYERS["Convolution"]) == {PLAIN, BLOCKED, NHWC, BF16, BF16_NHWC}
    assert set(LAYERS["LRN"]) == {PLAIN, BLOCKED, VIA_NCHW, NHWC}
    assert {name for name, variants in LAYERS.items() if NHWC in variants} == \
        {"Convolution", "Pooling", "BatchNorm", "Scale", "Bias", "Concat", "LRN"}
    assert set(LAYERS["InnerProduct"]) == {PLAIN, MODEL_PARALLEL, BF16}
    assert all(PLAIN in variants for variants in LAYERS.values())


def test_duplicate_registration_is_refused():
    with pytest.raises(RuntimeError, match="registered twice"):
        register(type("Split", (Layer,), {}))
    with pytest.raises(RuntimeError, match="layer type 'Convolution': variant 'blocked' registered twice"):
        register(variant=BLOCKED)(type("Again", (Layer,), {"type": "Convolution"}))
    with pytest.raises(RuntimeError, match="'NoSuchType': variant 'blocked' registered before the plain"):
        register(variant=BLOCKED)(type("Orphan", (Layer,), {"type": "NoSuchType"}))


def test_unknown_type_and_variant_list_the_known_ones():
    with pytest.raises(LayerError, match=r"layer 'layer' \(Convolutio\): type: unknown layer type "
                                         r"'Convolutio'\. did you mean 'Convolution'\? Known types: .*Convolution, "):
        create_layer(layer_param("Convolutio"), 0)
    with pytest.raises(LayerError, match=r"type: ReLU has no 'blocked' implementation\. Its variants: plain"):
        create_layer(layer_param("ReLU"), 0, variant=BLOCKED)


MARKED = "inner_product_param { num_output: 4 } multinode { model_parts: 0 }"


def test_model_parallel_variant_needs_a_distributed_context_and_a_mark():
    # the choice only: constructing a layer needs no communicator until its setup
    two = RunContext(rank=0, size=2)
    assert type(create_layer(layer_param("InnerProduct", MARKED), 0, context=two)).variant == MODEL_PARALLEL
    layer = create_layer(layer_param("InnerProduct", MARKED), 0)
    assert layer.variant == PLAIN and layer.context.size == 1
    unmarked = create_layer(layer_param("InnerProduct", "inner_product_param { num_output: 4 }"), 0,
                            context=two)
    assert unmarked.variant == PLAIN and unmarked.context is two


def test_model_parallel_rules_are_checked_when_the_factory_chooses():
    bad = layer_param("InnerProduct", "inner_product_param { num_output: 1 } multinode { model_parts: 0 }")
    with pytest.raises(ParallelError, match=r"num_output: must be at least the number of ranks \(2\)"):
        create_layer(bad, 0, context=RunContext(rank=0, size=2))


def test_the_net_only_asks_the_factory():
    """net.py imports no layer family (the layers package only registers them), and no code
    swaps a layer's methods at run time."""
    import ast
    import pathlib
    import caffepy
    root = pathlib.Path(caffepy.__file__).parent
    tree = ast.parse((root / "net.py").read_text())
    imported = {(node.module or "") + "." + alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not [name for name in imported if name.startswith("layers.")], imported
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    assert not (isinstance(target, ast.Attribute)
                                and target.attr in ("forward", "backward", "reshape")), \
                        f"{path.name}:{node.lineno} assigns a layer's {target.attr}"


def test_bf16_gives_way_to_the_model_parallel_inner_product(monkeypatch):
    from caffepy import precision
    monkeypatch.setenv("CAFFEPY_BF16", "emulate")
    precision.set_precision("bf16")
    try:
        two = RunContext(rank=0, size=2)
        marked = create_layer(layer_param("InnerProduct", MARKED), 0, context=two)
        unmarked = create_layer(layer_param("InnerProduct", "inner_product_param { num_output: 4 }"), 0,
                                context=two)
    finally:
        precision.set_precision("f32")
    assert (marked.variant, unmarked.variant) == (MODEL_PARALLEL, BF16)
