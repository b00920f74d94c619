"""The hand-written stubs of the native modules match what the extension exports."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["pyengine._sched", "pyengine._kernels", "pyengine._native"])
def test_stub_matches_the_native_module(tmp_path, module):
    # Run outside the source tree so the installed package is the one checked.
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", module],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
