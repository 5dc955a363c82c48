"""The import graph of ``src/`` (read with ``ast``, nothing imported): no import circle, and no
import of sm120patch inside a function except at the command-line edge, which imports each
command lazily to keep ``status`` fast. Imports under ``if TYPE_CHECKING:`` and inside functions
count as edges: a circle hidden there is still a circle."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "sm120patch"
# The command-line edge: imports inside its functions keep `status` fast (cli.py says so).
CLI_EDGE = {"sm120patch.cli", "sm120patch.__main__"}

# No circle is left (issue #39 removed the last three); one that appears fails the test.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in SRC.rglob("*.py")}


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The sm120patch modules an import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
            parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def _imports(module: str) -> tuple[set[str], Counter]:
    """Every sm120patch module ``module`` imports, and how many of its imports of sm120patch sit
    inside a function."""
    edges: set[str] = set()
    in_functions: Counter = Counter()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(module, child)
                edges.update(targets)
                if in_function and targets:
                    in_functions[module] += 1
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(MODULES[module].read_text(), str(MODULES[module])), False)
    return edges, in_functions


GRAPH = {}
FUNCTION_IMPORTS: Counter = Counter()
for _module in MODULES:
    GRAPH[_module], _counts = _imports(_module)
    FUNCTION_IMPORTS.update(_counts)
# Imported by name (importlib), which ast does not see as an import: the rewriters package loads
# its family modules when a rewriter is first asked for. They are edges all the same.
BY_NAME = {"sm120patch.rewriters": {f"sm120patch.rewriters.{family}" for family in ("cuda", "python")}}
for _module, _targets_by_name in BY_NAME.items():
    GRAPH[_module] |= _targets_by_name


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(m.removeprefix("sm120patch.") for m in component))
    return found


def test_no_new_import_circle():
    circles = set(_circles(GRAPH))
    assert circles <= KNOWN_CIRCLES, f"new import circle(s): {[sorted(c) for c in circles - KNOWN_CIRCLES]}"
    # A circle that is gone leaves the list, so it cannot come back unnoticed.
    assert circles == KNOWN_CIRCLES, f"no longer circles, remove them here: {[sorted(c) for c in KNOWN_CIRCLES - circles]}"


def test_no_import_inside_a_function_outside_the_command_line():
    counts = {m.removeprefix("sm120patch."): n for m, n in FUNCTION_IMPORTS.items() if m not in CLI_EDGE}
    assert not counts, f"imports of sm120patch inside a function, outside cli.py: {counts}"


def test_the_modules_imported_by_name_are_listed():
    from sm120patch import rewriters

    assert BY_NAME["sm120patch.rewriters"] == {f"sm120patch.rewriters.{f}" for f in rewriters.FAMILIES}
    assert BY_NAME["sm120patch.rewriters"] <= set(MODULES)


def test_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]


def test_the_tree_interface_is_about_files_and_imports_nothing_above_it():
    """The bottom of the house: the planner's view of a tree knows no plan, report, checkout,
    assessment or writer, and its interface is small (files, the release's bytes, the ledger)."""
    from typing import Protocol

    from sm120patch.trees import Tree

    above = {"plan", "reports", "checkout", "assess", "write", "pipeline", "installed", "jitcache", "transaction"}
    assert not {m.removeprefix("sm120patch.") for m in GRAPH["sm120patch.trees"]} & above
    members = {name for name in vars(Tree) if not name.startswith("_")} | set(Tree.__annotations__)
    members -= set(vars(Protocol))
    assert len(members) <= 12, sorted(members)
    assert {"read", "release_sha256", "release_bytes", "saved_original", "read_ledger"} <= members


def _layer_map() -> list[tuple[str, list[str]]]:
    """The README's layer map: one line per layer, top to bottom, its name then its modules."""
    text = (SRC.parents[1] / "README.md").read_text()
    block = text[text.index("each imports only its own and the layers below it"):]
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    layers = []
    for line in block.splitlines():
        name, _, modules = line.partition("  ")
        layers.append((name.strip(), modules.split()))
    return layers


def test_the_readme_layer_map_is_the_import_graph():
    """Every module is on the map once, and no module imports one on a higher line."""
    layers = _layer_map()
    where = {}
    for index, (_, modules) in enumerate(layers):
        for module in modules:
            assert module not in where, f"{module} is on the map twice"
            where[module] = index
    names = {m.removeprefix("sm120patch.") for m in GRAPH}
    assert set(where) == names, f"not on the map: {sorted(names - set(where))}; not a module: {sorted(set(where) - names)}"
    upward = [(m, t) for m, targets in GRAPH.items() for t in targets
              if where[t.removeprefix("sm120patch.")] < where[m.removeprefix("sm120patch.")]]
    assert not upward, f"imports from a lower layer up: {upward}"
