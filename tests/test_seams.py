"""The seams of STYLE.md that the code's structure shows: parallel code plugs in through the
solver's hooks and the run context; layers and solvers never reach for caffepy.parallel."""
import ast
import pathlib

import caffepy

ROOT = pathlib.Path(caffepy.__file__).parent


def imported_modules(source, package):
    """Every module and name `source` (code of a module in `package`) imports, absolute."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                module = ".".join(parts[:len(parts) - node.level + 1] + ([module] if module else []))
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def test_the_import_check_sees_relative_imports():
    assert "caffepy.parallel" in imported_modules("from ..parallel import world", "caffepy.layers")
    assert "caffepy.parallel" in imported_modules("from .. import parallel", "caffepy.solvers")
    assert "caffepy.parallel" in imported_modules("import caffepy.parallel", "caffepy.layers")


def test_layers_and_solvers_import_nothing_from_parallel():
    for package in ("layers", "solvers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found = [m for m in imported_modules(path.read_text(), f"caffepy.{package}")
                     if m == "caffepy.parallel" or m.startswith("caffepy.parallel.")]
            assert not found, f"{path.relative_to(ROOT.parent)} imports {found}"


def test_parallel_code_never_assigns_to_a_solver():
    """Strategies join the loop through solver.hooks; none replaces a solver's method or field."""
    for path in sorted((ROOT / "parallel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                assert not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == "solver"), \
                    f"{path.name}:{node.lineno} assigns solver.{target.attr}"


def test_hooks_declares_every_point_the_solver_calls():
    """The protocol lives in one place: each name the solver looks up on its hooks (or calls
    on the one hook that settles the iteration records, `lag`) is a method of Hooks, and each
    method of Hooks is called by the solver."""
    from caffepy.parallel.strategies import DataParallel
    from caffepy.solvers.solver import Hooks
    tree = ast.parse((ROOT / "solvers" / "solver.py").read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    called = {node.args[0].value for node in calls
              if node.func.attr == "_hooks" and node.args and isinstance(node.args[0], ast.Constant)}
    called |= {node.func.attr for node in calls
               if isinstance(node.func.value, ast.Name) and node.func.value.id == "lag"}
    declared = {name for name, value in vars(Hooks).items() if callable(value) and not name.startswith("_")}
    assert called == declared
    assert issubclass(DataParallel, Hooks)


def private_names_from_siblings(source):
    """The `_private` names a module of caffepy/layers takes from another one: imported by name
    (`from .nhwc import _Direct`) or read off an imported sibling (`from . import nhwc`;
    `nhwc._k`). Compiled kernel modules (`from ..kernels import nhwc as _k`) are not siblings."""
    tree = ast.parse(source)
    siblings, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                if node.module is None:
                    siblings.add(alias.asname or alias.name)
                elif alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in siblings and node.attr.startswith("_"):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_private_name_check_sees_both_forms():
    assert private_names_from_siblings("from .nhwc import _Direct, rows") == ["nhwc._Direct"]
    assert private_names_from_siblings("from . import nhwc\nnhwc._k.max_threads()") == ["nhwc._k"]
    assert private_names_from_siblings("from ..kernels import nhwc as _k\n_k.pack()") == []


def test_layer_modules_take_no_private_names_from_each_other():
    """One algorithm family, one module (STYLE.md): the convolution algorithms that the
    channels-last and the blocked layers share live in layers/conv_algorithms.py, and neither
    layout's module reaches into the other's (nor any layer module into another's)."""
    for path in sorted((ROOT / "layers").glob("*.py")):
        found = private_names_from_siblings(path.read_text())
        assert not found, f"{path.relative_to(ROOT.parent)} takes {found}"
