"""The house rules that keep the code readable: imports point one way with no circle, the
model interface imports nothing of ours, the runtime never imports the training code, and the
speculative step stays on one screen."""
import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from specdec import decoding

ROOT = Path(specdec.__file__).parent
# Each layer may import from the layers after it, never from one before it.
LAYERS = [("cli", "bench", "train"), ("server",), ("batcher",), ("decoding",), ("request", "bridge"), ("drafters",), ("datastore", "schedule"),
          ("sampling",), ("models",)]


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """The specdec modules `path` imports, anywhere in it (function-level imports included)."""
    here = module_of(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            if not name.startswith("specdec"):
                continue
            for alias in node.names:  # `from . import kernel` imports a module
                sub = f"{name}.{alias.name}"
                found.add(sub if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists() else name)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("specdec")}
    return found - {module_of(path)}


def graph() -> dict[str, set[str]]:
    return {module_of(p): imports(p) for p in ROOT.rglob("*.py")}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(LAYERS) if top in names), -1)


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(g.get(m, ())):
            assert state.get(n) != 1, f"import circle: {' -> '.join(path + [n])}"
            if n in g and n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_imports_point_one_way():
    for m, deps in graph().items():
        if layer(m) < 0:  # the package's own __init__ gathers the public names
            continue
        for d in deps:
            if layer(d) >= 0:
                assert layer(d) >= layer(m), f"{m} imports {d}, a layer above it"


def test_the_model_interface_imports_nothing_of_ours():
    assert imports(ROOT / "models" / "base.py") == set()


def test_the_runtime_never_imports_the_training_code():
    code = "import sys, specdec, specdec.cli, specdec.bench.runner; print(any(m.startswith('specdec.train') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("function, limit", [(decoding.speculative_generate, 45), (decoding.speculative_step, 40)])
def test_the_speculative_step_fits_a_screen(function, limit):
    source = inspect.getsource(function)
    doc = ast.parse(source).body[0].body[0]  # the docstring's lines are not code
    lines = source.splitlines()
    code = [line for i, line in enumerate(lines, 1) if not doc.lineno <= i <= doc.end_lineno
            and line.strip() and not line.strip().startswith("#")]
    assert len(code) <= limit, f"{function.__name__} has {len(code)} code lines"
    for word in ("tree", "head", "isinstance", "AdaptiveK", "FixedK"):  # no kind of schedule or drafter is asked
        assert not any(word in line for line in code), word


def test_the_check_sees_a_circle_and_a_wrong_way_import(tmp_path, monkeypatch):
    # The checks above must be able to fail: a module importing upwards is caught.
    fake = {"specdec.models.base": {"specdec.decoding"}, "specdec.decoding": {"specdec.models.base"}}
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: fake)
    for check in (test_no_import_circle, test_imports_point_one_way):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} passed on a broken graph")
