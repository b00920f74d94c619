"""The product must not depend on its test helpers.

``pyengine/testing/`` holds what tests and benchmarks need (tiny checkpoints of every
architecture, hand-built plans, reference forwards). Once the product imports from it, a
test helper becomes a product dependency nobody reviews as one, and a change made for a
test silently changes what users run. The scan reads the source tree, so it needs neither
the native module nor torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyengine"
TESTING = "pyengine.testing"


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in ``path``, relative ones resolved;
    ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a submodule)."""
    name = _module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _is_testing(module: str) -> bool:
    return module == TESTING or module.startswith(TESTING + ".")


def test_product_modules_do_not_import_testing():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (PACKAGE / "testing") not in path.parents
        for line, module in _imported_modules(path)
        if _is_testing(module)
    ]
    assert not offenders, "product code imports pyengine.testing:\n" + "\n".join(offenders)


def test_the_scan_sees_every_spelling(tmp_path):
    """The scan itself: absolute, ``from``, relative and lazy (in-function) imports of the
    testing package are caught; ``pyengine.server.testing`` is a different module."""
    package = tmp_path / "pyengine"
    (package / "engine").mkdir(parents=True)
    caught = {
        "a.py": "import pyengine.testing.checkpoints\n",
        "b.py": "from pyengine import testing\n",
        "engine/c.py": "def f():\n    from ..testing.hand_plan import HandPlanner\n",
        "__init__.py": "from .testing import checkpoints\n",
    }
    for rel, source in {**caught, "d.py": "import pyengine.server.testing\n"}.items():
        (package / rel).write_text(source)
    for rel in caught:
        assert any(_is_testing(m) for _, m in _imported_modules(package / rel, package)), rel
    assert not any(_is_testing(m) for _, m in _imported_modules(package / "d.py", package))
