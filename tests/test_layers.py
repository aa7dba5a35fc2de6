"""Layering for every module: import-linter's contracts in pyproject.toml (protocol <- model <-
runtime <- stage <- driver <- api <- launch <- cli; the protocol torch-free; the API layer
knowing no frames or stages), and no import cycle between any two modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).parent.parent


def test_import_contracts_hold():
    # In a process of its own: import-linter configures logging with dictConfig, which
    # disables every logger that already exists (the suite's tests read their warnings).
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def import_cycles(graph) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), sorted."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.find_modules_directly_imported_by(module):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while (member := stack.pop()) != module:
                on_stack.discard(member)
                group.append(member)
            on_stack.discard(module)
            if group:
                groups.append(sorted([module, *group]))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(groups)


def test_no_import_cycles():
    # Imports under `if TYPE_CHECKING:` never run (a stage's handlers annotate the
    # connection that dispatches to them), so they are not cycles.
    graph = grimp.build_graph("skippy", cache_dir=None, exclude_type_checking_imports=True)
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_the_stage_package_has_no_import_cycle_even_for_type_checking():
    """A stage module typed against another's insides is coupled to it as much as one that
    imports it to run: inside skippy.stage, not even `if TYPE_CHECKING:` imports form a cycle."""
    graph = grimp.build_graph("skippy", cache_dir=None, exclude_type_checking_imports=False)
    assert [group for group in import_cycles(graph) if any(m.startswith("skippy.stage") for m in group)] == []


# asyncio's objects keep their state in underscored attributes (a StreamReader's unread
# bytes, a transport's protocol, a future's loop): none of skippy's code may reach for them
ASYNCIO_PRIVATE = {"_buffer", "_transport", "_protocol", "_loop", "_waiter", "_paused", "_eof", "_stream_reader",
                   "_ssl_protocol", "_sock", "_ready", "_scheduled", "_selector", "_stdout", "_exception"}


def test_no_module_reads_asyncio_private_attributes():
    import ast

    offences = []
    for path in sorted((ROOT / "skippy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ASYNCIO_PRIVATE
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert offences == []
