"""No import cycle inside ``pyengine/``.

A cycle makes what a module sees depend on which module of the cycle was imported first
(one of them runs against a half-initialised other), and it hides a dependency that runs
the wrong way: configuration that imports the attention selector, the model layers that
import the executor. The scan reads the source tree (needing neither torch nor the native
module) and follows module-level imports only: an import inside a function runs when the
function is called, after every module is whole, and one under ``if TYPE_CHECKING:``
never runs. ``from package import name`` is an edge to the submodule ``name`` when it is
one, else to the package's ``__init__``; the implicit import of a module's parent
packages is not an edge (every module would otherwise sit on a cycle with
``pyengine/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyengine"


def _module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: the body's, and those inside
    module-level ``if`` / ``try`` / ``with`` blocks (not ``if TYPE_CHECKING:``), never
    a function's or a class's."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            pending += node.orelse if _is_type_checking(node.test) else node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                pending += handler.body
        elif isinstance(node, ast.With):
            pending += node.body
    return found


def import_graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the modules of the package it imports at module level."""
    files = {_module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}
    # The native modules (``_kernels``, ``_sched``, ``_native``) are known by their stubs;
    # they import nothing of the package.
    native = {_module_name(path, package_dir) for path in package_dir.rglob("*.pyi")} - set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _module_level_imports(tree):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in files)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in files:
                    edges.add(submodule)
                elif submodule in native:
                    continue
                elif base in files:
                    edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm,
    iterative), each sorted, plus one path around each so the report shows the loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth-first,
    inside the component), so the report shows the loop to break."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    return component


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in pyengine/ (module-level imports):\n" + "\n".join(
        " -> ".join(_loop(graph, component)) for component in cycles
    )


def test_the_model_code_imports_nothing_of_the_executor():
    """The executor runs the models (attention backends hand the layers an ``AttentionOp``),
    so ``pyengine/models/`` must not import ``pyengine.executor``, lazily or not: the two
    packages would depend on each other."""
    offenders = []
    for path in sorted((PACKAGE / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("pyengine.executor")]
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and (node.module or "").startswith("executor"):
                offenders.append(f"{path.name}:{node.lineno} ..{node.module}")
    assert not offenders, "pyengine/models imports the executor:\n" + "\n".join(offenders)


def test_the_scan_sees_a_planted_cycle(tmp_path):
    """The scan itself: a cycle through a relative import and a ``from package import
    submodule`` is found and reported as a loop; an import inside a function, one under
    ``if TYPE_CHECKING:`` and a module's parent package are not edges."""
    package = tmp_path / "pyengine"
    (package / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from pyengine.a import A\n",
        "a.py": "from .sub import b\nA = 1\n",
        "sub/__init__.py": "",
        "sub/b.py": "try:\n    from ..c import C\nexcept ImportError:\n    C = None\n",
        "c.py": "import pyengine.a\nC = 2\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pyengine.e import E\n"
        "def f():\n    from pyengine import e\n",
        "e.py": "from pyengine.d import f\nE = 3\n",
    }
    for rel, source in sources.items():
        (package / rel).write_text(source)
    graph = import_graph(package)
    assert graph["pyengine.sub.b"] == {"pyengine.c"}
    assert graph["pyengine.d"] == set()
    assert find_cycles(graph) == [["pyengine.a", "pyengine.c", "pyengine.sub.b"]]
    assert _loop(graph, ["pyengine.a", "pyengine.c", "pyengine.sub.b"]) == [
        "pyengine.a", "pyengine.sub.b", "pyengine.c", "pyengine.a"
    ]
