"""No two classes share a name inside ``pyengine/``.

Two classes of one name (two ``ChatTemplate``s, two ``CoreProcess``es) make every reader,
import and traceback ask which one is meant, and often hide code written twice. Private
classes count too: a second ``_Chunk`` was a copy of the first. The scan reads the source
tree, so it needs neither torch nor the native module (whose classes, ``StepPlan`` and
``OutputEvent``, have no Python twin of the same name either: those are checked against
the stubs).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyengine"


def class_definitions(package_dir: Path = PACKAGE) -> dict[str, list[str]]:
    """Class name -> where each class of that name is defined (``path:line``), over the
    package's sources and its native modules' stubs (``*.pyi``)."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted([*package_dir.rglob("*.py"), *package_dir.rglob("*.pyi")]):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(f"{path.relative_to(package_dir.parent)}:{node.lineno}")
    return found


def duplicates(definitions: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: places for name, places in definitions.items() if len(places) > 1}


def test_no_two_classes_share_a_name():
    shared = duplicates(class_definitions())
    assert not shared, "classes that share a name in pyengine/:\n" + "\n".join(
        f"{name}: {', '.join(places)}" for name, places in sorted(shared.items())
    )


def test_the_scan_sees_a_planted_duplicate(tmp_path):
    """Nested, private and stub classes are seen; one name per class passes."""
    package = tmp_path / "pyengine"
    (package / "server").mkdir(parents=True)
    (package / "a.py").write_text("class Plan:\n    class _Row:\n        pass\n")
    (package / "server" / "b.py").write_text("def f():\n    class _Row:\n        pass\n")
    (package / "_native.pyi").write_text("class Plan: ...\n")
    (package / "c.py").write_text("class Other:\n    pass\n")
    assert duplicates(class_definitions(package)) == {
        "Plan": ["pyengine/_native.pyi:1", "pyengine/a.py:1"],
        "_Row": ["pyengine/a.py:2", "pyengine/server/b.py:2"],
    }
