"""The package's layers import only downwards: formats -> planner -> nn -> passes / training
/ compile -> api, cli. A module may import its own layer or any layer below, never above
(imports inside functions count too: a lazy import still couples the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "comera_compile"

LAYERS: dict[str, int] = {
    # leaf helpers that import nothing of the package
    "tables": 0,
    # the chain of the design, bottom to top
    "formats": 1,
    "planner": 2,
    "nn": 3,
    "passes": 4,
    "training": 4,
    "compile": 4,
    "config": 4,  # CompressionConfig / CompileOptions: read by compile, built by api
    "io": 5,  # save / load: layers and the optimize report
    "api": 6,
    "cli": 7,  # the command, its model specs and the demo with its models
    "integrations": 7,
    "__init__": 8,
}


def _module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0].removesuffix(".py")


def imported_layers(source: str, module: list[str], is_package: bool) -> list[tuple[int, str]]:
    """``(line, top-level part)`` of every ``comera_compile`` import in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = module if is_package else module[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                targets = [node.module or ""]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == "comera_compile" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def upward_imports(path: Path, source: str | None = None) -> list[str]:
    """Every import in ``path`` that points up the layering, as readable lines."""
    source = path.read_text() if source is None else source
    own = _layer_of(path)
    bad = []
    for line, target in imported_layers(source, _module_name(path), path.name == "__init__.py"):
        if target not in LAYERS:
            bad.append(f"{path.name}:{line}: '{target}' has no layer; add it to LAYERS")
        elif LAYERS[target] > LAYERS[own]:
            bad.append(f"{path.relative_to(PACKAGE)}:{line}: {own} (layer {LAYERS[own]}) "
                       f"imports {target} (layer {LAYERS[target]})")
    return bad


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_top_level_part_has_a_layer():
    parts = {_layer_of(path) for path in MODULES}
    assert parts <= set(LAYERS), f"give these a layer: {sorted(parts - set(LAYERS))}"
    assert {"formats", "planner", "nn", "passes", "api"} <= parts


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    assert upward_imports(path) == []


@pytest.mark.parametrize(
    "where, source, expected",
    [
        ("formats/tt.py", "from comera_compile.api import optimize", "imports api"),
        ("planner/plan.py", "def f():\n    from comera_compile.nn import TTLinear", "imports nn"),
        ("nn/base.py", "from ..passes import rewrite", "imports passes"),
        ("nn/__init__.py", "from ..training import penalty", "imports training"),
        ("planner/cache.py", "import comera_compile.compile.backend", "imports compile"),
    ],
)
def test_an_upward_import_is_caught(where, source, expected):
    (problem,) = upward_imports(PACKAGE / where, source)
    assert expected in problem


def test_downward_and_sibling_imports_pass():
    source = "from ..formats import tt\nfrom . import gates"
    assert upward_imports(PACKAGE / "nn/base.py", source) == []
    assert upward_imports(PACKAGE / "training/distill.py", "from ..passes import inputs") == []


def test_api_uses_only_the_public_surface_of_passes():
    """optimize() reads the passes through ``comera_compile.passes.__all__``, never through a
    submodule or a name the package does not export."""
    import comera_compile.passes as passes

    tree = ast.parse((PACKAGE / "api.py").read_text())
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "comera_compile.passes"
        ):
            assert node.module == "comera_compile.passes", f"api.py imports {node.module}"
            used += [alias.name for alias in node.names]
    assert used and set(used) <= set(passes.__all__)


def test_importing_the_package_loads_no_demo_model_nor_the_compiler():
    """``import comera_compile`` loads the library: not the command line's demo models (they
    live in ``cli/``) and not dynamo or inductor (the backend loads them when it compiles)."""
    import subprocess
    import sys

    code = ("import sys, comera_compile\n"
            "print(sorted(m for m in sys.modules if m.startswith(('comera_compile.cli', "
            "'torch._dynamo', 'torch._inductor'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=PACKAGE.parent)
    assert done.stdout.strip() == "[]"
