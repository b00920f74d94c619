"""The hand-written stub of the native module matches what the module exports."""

from __future__ import annotations

import subprocess
import sys


def test_sched_stub_matches_the_native_module(tmp_path):
    # Run outside the source tree so the installed package is the one checked.
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "pyengine._sched"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
