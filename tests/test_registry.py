"""Every registered layer with a gradient has at least one gradient case."""
import glob
import importlib.util
import os
import sys

from caffepy.layer import LAYERS


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


def test_every_differentiable_layer_has_a_gradient_case():
    covered = {c.type for c in _all_cases() if c.grad}
    missing = sorted(name for name, cls in LAYERS.items() if cls.differentiable and name not in covered)
    assert not missing, f"layers without a gradient case: {missing}"


def test_duplicate_registration_is_refused():
    import pytest
    from caffepy.layer import Layer, register
    with pytest.raises(RuntimeError, match="registered twice"):
        register(type("Split", (Layer,), {}))
