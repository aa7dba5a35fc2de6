"""The protocol package's import rules (docs/style.md §6): no torch; asyncio only in stream.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import skippy.protocol

PACKAGE_DIR = Path(skippy.protocol.__file__).parent
MODULES = sorted(PACKAGE_DIR.glob("*.py"))


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_import_rules(path):
    roots = _imported_roots(path)
    assert "torch" not in roots
    assert "skippy" not in roots  # only relative imports inside the package, nothing from above
    if path.name != "stream.py":
        assert "asyncio" not in roots and "socket" not in roots
