"""The package's layering (docs/design.md section 2) and the one place where
backend names are compared (docs/design.md section 3), checked on the source."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from fp8rl.fp8 import BACKENDS

PACKAGE = Path(__file__).resolve().parent.parent / "fp8rl"

# What each layer may import from fp8rl (besides itself), lowest layer first.
ALLOWED = {
    "fp8": set(),
    "precision": {"fp8"},
    "optim": {"fp8"},
    "model": {"fp8", "precision"},
    "rollout": {"fp8", "precision", "model", "config"},
    "rl": set(),
    "tasks": set(),
}


def layer_of(module: str) -> str:
    """`fp8rl.fp8.quant` -> "fp8", `fp8rl.precision` -> "precision"."""
    return module.split(".")[1]


def fp8rl_imports(path: Path) -> set[str]:
    """Every fp8rl module a file imports, at module level or inside functions."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("fp8rl."):
            out.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # `from .config import ...`
            package = path.relative_to(PACKAGE.parent).parts[:-1]  # ("fp8rl", "model")
            base = list(package[: len(package) - (node.level - 1)])
            out.add(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("fp8rl.")}
    return out


@pytest.mark.parametrize("layer", list(ALLOWED))
def test_layers_import_only_lower_layers(layer: str):
    files = sorted(PACKAGE.glob(f"{layer}/*.py")) or [PACKAGE / f"{layer}.py"]
    assert files and all(f.is_file() for f in files)
    for f in files:
        for module in fp8rl_imports(f):
            assert layer_of(module) in ALLOWED[layer] | {layer}, f"{f.relative_to(PACKAGE)} imports {module}"


def test_the_import_checker_sees_imports():
    # the checker must be able to fail: these files do import across layers
    assert "fp8rl.precision" in fp8rl_imports(PACKAGE / "model" / "transformer.py")
    assert "fp8rl.model.config" in fp8rl_imports(PACKAGE / "model" / "transformer.py")  # `from .config import`


def backend_name_comparisons(path: Path) -> list[int]:
    """Lines where a string that names a backend is compared (==, !=, in)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            consts = [n for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in BACKENDS]
            if consts:
                lines.append(node.lineno)
    return lines


def test_no_backend_name_comparison_outside_the_registry():
    offenders = {
        str(f.relative_to(PACKAGE)): backend_name_comparisons(f)
        for f in PACKAGE.rglob("*.py")
        if f.name != "backends.py"
    }
    assert {f: lines for f, lines in offenders.items() if lines} == {}
    # ...and the check can fail: backends.py compares device types named like a backend
    assert backend_name_comparisons(PACKAGE / "fp8" / "backends.py")


BENCHMARKS = PACKAGE.parent / "benchmarks"


def shadowed_modules(folder: Path) -> list[str]:
    """The scripts of ``folder`` whose name is also an installed top-level module.

    ``python benchmarks/x.py`` puts ``benchmarks/`` first on ``sys.path``, so a
    script named like a package that a dependency imports replaces it there: a
    ``benchmarks/kernels.py`` made every transformers import fail (transformers 5
    requires Hugging Face's ``kernels`` package and imports it at start-up)."""
    return sorted(p.stem for p in folder.glob("*.py")
                  if p.stem in sys.stdlib_module_names or importlib.util.find_spec(p.stem) is not None)


def test_no_benchmark_script_shadows_an_installed_module():
    assert str(BENCHMARKS) not in sys.path  # else find_spec would find the scripts themselves
    assert shadowed_modules(BENCHMARKS) == []


def test_the_shadowing_check_sees_a_shadowing_script(tmp_path: Path):
    for name in ("pytest", "json", "surely_no_such_module_here"):
        (tmp_path / f"{name}.py").write_text("")
    assert shadowed_modules(tmp_path) == ["json", "pytest"]
