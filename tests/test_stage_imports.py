"""Layers import only downward (docs/style.md §6): telemetry <- protocol <- model <- runtime
<- stage <- frontend <- cli."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import skippy

PACKAGE = Path(skippy.__file__).parent
LAYERS = ["telemetry", "protocol", "model", "runtime", "stage", "frontend", "cli"]
CHECKED = (["telemetry.py"] + [f"runtime/{n}" for n in ("session.py", "step.py", "scheduler.py",
                                                         "runner.py", "engine.py")]
           + sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "stage").glob("*.py"))
           + [f"frontend/{n}" for n in ("driver.py", "chain_session.py", "chunking.py",
                                        "local_chain.py")])


def skippy_imports(path: Path) -> set[str]:
    """Top-level skippy packages imported by a module (relative imports resolved)."""
    package = path.relative_to(PACKAGE).parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    found.add(parts[0].removesuffix(".py"))
            elif node.module and node.module.startswith("skippy."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("skippy."))
    return found


def layer_of(relative: str) -> str:
    return relative.split("/")[0].removesuffix(".py")


@pytest.mark.parametrize("relative", CHECKED)
def test_imports_only_point_down(relative):
    layer = LAYERS.index(layer_of(relative))
    for target in skippy_imports(PACKAGE / relative):
        if target in LAYERS:
            assert LAYERS.index(target) <= layer, f"{relative} imports {target}"
    if relative == "telemetry.py":
        assert skippy_imports(PACKAGE / relative) == set()
