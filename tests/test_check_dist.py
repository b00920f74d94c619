"""The artifact check CI runs (``.ci/check_dist.py``) refuses a wheel without its stubs or
``py.typed``, one that ships the repository's test trees, and an incomplete sdist."""

from __future__ import annotations

import importlib.util
import tarfile
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "check_dist.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_dist", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_wheel_without_stubs_or_with_tests_is_refused(check, tmp_path):
    wheel = tmp_path / f"pyengine-0.1.0-{check.WHEEL_TAG}.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in check.WHEEL_NEEDS:
            if name not in ("pyengine/py.typed", "pyengine/_kernels.pyi"):
                z.writestr(name, "")
        z.writestr("tests/test_engine.py", "")
        z.writestr("pyengine/testing/conftest.py", "")
    problems = "\n".join(check.check_wheel(wheel))
    assert "lacks pyengine/py.typed" in problems and "lacks pyengine/_kernels.pyi" in problems
    assert "ships tests/test_engine.py" in problems and "ships pyengine/testing/conftest.py" in problems


def test_a_wheel_with_another_tag_is_refused(check, tmp_path):
    wheel = tmp_path / "pyengine-0.1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in check.WHEEL_NEEDS:
            z.writestr(name, "")
    assert any("not tagged" in p for p in check.check_wheel(wheel))


def test_an_sdist_without_the_lock_file_is_refused(check, tmp_path):
    sdist = tmp_path / "pyengine-0.1.0.tar.gz"
    source = tmp_path / "src"
    for name in check.SDIST_NEEDS:
        if name != "Cargo.lock":
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_text("")
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(source, arcname="pyengine-0.1.0")
    assert check.check_sdist(sdist) == [f"{sdist.name}: lacks Cargo.lock"]
