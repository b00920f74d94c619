#!/usr/bin/env python3
"""Checks the artifacts users get: ``check_dist.py WHEEL_OR_SDIST...``.

A wheel must be the one wheel per platform (abi3 for CPython >= 3.10, tagged
manylinux_2_28, which ``auditwheel show`` must confirm when it is installed), carry the
native extension, its stubs and ``py.typed``, and ship nothing of the repository's test
or build trees. An sdist must carry everything a source build needs (the Cargo
workspace, its lock file, every crate, the package, the stubs). Exits non-zero with the
list of problems."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

WHEEL_TAG = "cp310-abi3-manylinux_2_28_x86_64"
WHEEL_NEEDS = ["pyengine/py.typed", "pyengine/_native.pyi", "pyengine/_sched.pyi", "pyengine/_kernels.pyi",
               "pyengine/_native.abi3.so", "pyengine/__init__.py"]
# Repository trees that are not part of the product. (pyengine/testing is: the benches
# and the test suite run against the installed package and import it.)
WHEEL_MUST_NOT = re.compile(r"^(tests|benches|rust_sched|docs|\.ci)/|(^|/)conftest\.py$|^pyengine/_sched.*\.so$")
SDIST_NEEDS = ["pyproject.toml", "Cargo.toml", "Cargo.lock", "README.md", "rust_sched/sched/Cargo.toml",
               "rust_sched/sched/src/lib.rs", "rust_sched/kernels/Cargo.toml", "rust_sched/kernels/src/lib.rs",
               "rust_sched/python/Cargo.toml", "rust_sched/python/src/lib.rs", "pyengine/__init__.py",
               "pyengine/py.typed", "pyengine/_sched.pyi", "pyengine/_kernels.pyi", "pyengine/_native.pyi"]


def check_wheel(path: Path) -> list[str]:
    problems = []
    if WHEEL_TAG not in path.name:
        problems.append(f"{path.name}: not tagged {WHEEL_TAG}")
    names = zipfile.ZipFile(path).namelist()
    problems += [f"{path.name}: lacks {need}" for need in WHEEL_NEEDS if need not in names]
    problems += [f"{path.name}: ships {name}" for name in names if WHEEL_MUST_NOT.search(name)]
    auditwheel = shutil.which("auditwheel")
    if auditwheel is None:
        problems.append("auditwheel is not installed: the manylinux tag cannot be confirmed")
    else:
        shown = subprocess.run([auditwheel, "show", str(path)], capture_output=True, text=True, check=False)
        if '"manylinux_2_28_x86_64"' not in " ".join(shown.stdout.split()):
            problems.append(f"{path.name}: auditwheel does not confirm manylinux_2_28_x86_64:\n{shown.stdout}"
                            f"{shown.stderr}")
    return problems


def check_sdist(path: Path) -> list[str]:
    with tarfile.open(path) as archive:
        # Members sit under one top folder, pyengine-VERSION/.
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    return [f"{path.name}: lacks {need}" for need in SDIST_NEEDS if need not in names]


def main(paths: list[str]) -> int:
    if not paths:
        print("usage: check_dist.py WHEEL_OR_SDIST...", file=sys.stderr)
        return 2
    problems = []
    for name in paths:
        path = Path(name)
        problems += check_wheel(path) if path.suffix == ".whl" else check_sdist(path)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print("ok:", ", ".join(Path(p).name for p in paths))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
