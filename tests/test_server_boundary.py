"""The server sees the engine only through ``EngineClient`` (issue 10: the next step puts
the engine core in another process, where nothing else will be reachable).

Read from the source with ``ast``, so it needs neither torch nor the native module:
no module under ``pyengine/server`` imports ``pyengine.engine`` (or builds an engine,
except the CLI, which is where the engine is made), and every attribute the server reads
off an engine is one ``EngineClient`` declares.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pyengine"
SERVER = sorted((ROOT / "server").glob("*.py"))
ENGINE_NAMES = {"engine", "_engine", "engine_client"}  # what the server calls its EngineClient


def _client_api() -> set[str]:
    tree = ast.parse((ROOT / "entrypoints" / "engine_client.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineClient")
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


def _is_engine(node: ast.expr) -> bool:
    """``engine``, ``ctx.engine_client``, ``self.engine_client``..., the client as the server names it."""
    return (isinstance(node, ast.Name) and node.id in ENGINE_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr in ENGINE_NAMES)


def test_the_server_imports_nothing_of_the_engine():
    assert SERVER, "no server modules found"
    bad = []
    for path in SERVER:
        for module in _imports(ast.parse(path.read_text())):
            if module == "pyengine.engine" or module.startswith("pyengine.engine."):
                bad.append(f"{path.name}: {module}")
            if module == "pyengine.entrypoints.async_engine" and path.name != "cli.py":
                bad.append(f"{path.name}: {module} (only the CLI builds an engine; the rest takes an EngineClient)")
    assert not bad, bad


def test_the_server_reads_only_the_engine_client_api():
    api = _client_api()
    assert {"generate", "abort", "embed", "health", "stats", "tokenizer", "shutdown"} <= api
    bad = []
    for path in SERVER:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _is_engine(node.value) and node.attr not in api:
                bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not bad, f"the server reaches past EngineClient: {bad}"


def test_the_multiprocess_client_implements_the_interface_without_the_engine():
    """``MultiprocessEngine`` is the other ``EngineClient``: it defines every abstract
    method itself, and the front end's modules never import the engine core (that runs in
    the core process: ``core_loop.py`` / ``core_main.py``)."""
    tree = ast.parse((ROOT / "entrypoints" / "engine_client.py").read_text())
    base = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineClient")
    abstract = {n.name for n in base.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and any(ast.unparse(d) == "abstractmethod" for d in n.decorator_list)}
    client = ast.parse((ROOT / "multiprocess" / "client.py").read_text())
    cls = next(n for n in client.body if isinstance(n, ast.ClassDef) and n.name == "MultiprocessEngine")
    defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert abstract and abstract <= defined, sorted(abstract - defined)
    for name in ("client.py", "transport.py", "cores.py", "processes.py", "request_prep.py", "queries.py",
                 "streams.py", "front_text.py", "stats_merge.py", "wire.py"):
        imported = _imports(ast.parse((ROOT / "multiprocess" / name).read_text()))
        # The constraint compiler is the one exception: the front end compiles a request's
        # grammar too, to refuse a bad one before sending it.
        engine = [m for m in imported if (m.startswith("pyengine.engine.") or m == "pyengine.engine")
                  and m != "pyengine.engine.grammar"]
        assert not engine, (name, engine)
