"""The engine's side never loads the web stack (issue 22, item 1).

``pyengine core`` (an engine-core process, on this host or another) and ``pyengine generate``
(the offline batch tool) parse the same engine flags as ``pyengine serve``; the flags are
the engine's configuration (``pyengine/cli/engine_flags.py``), so parsing them, or running
a whole engine core, imports no HTTP framework. Checked in fresh processes, where
``sys.modules`` says what was really imported. ``pyengine core --help`` imports no torch
(or numpy) either: a core pins its CPUs before anything that starts threads is imported.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from pyengine import EngineConfig, LinkOptions, make_engine_client
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.waits import free_ports

WEB_STACK = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "structlog")

_HELP = """
import contextlib, io, json, sys
from pyengine.cli.main import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main([sys.argv[1], "--help"])
    except SystemExit:
        pass
assert "usage" in out.getvalue(), out.getvalue()
print(json.dumps(sorted(sys.modules)))
"""

# A remote ``pyengine core`` that writes the modules it has loaded when it exits (its
# ``main`` ends with ``os._exit``, past every atexit hook).
_CORE = """
import json, os, sys
report = sys.argv.pop(1)
real_exit = os._exit

def exit_reporting(code):
    with open(report, "w") as f:
        json.dump(sorted(sys.modules), f)
    real_exit(code)

os._exit = exit_reporting
from pyengine.multiprocess.core_main import main
sys.exit(main(sys.argv[1:]))
"""


# The children run from an empty folder (the test's tmp_path): ``python -c`` and ``-m`` put
# the current folder first on sys.path, and from the repository root (where CI runs the
# tests against the installed wheel) that is the source folder, which holds no native module.


def _modules_after_help(command: str, away) -> set[str]:
    done = subprocess.run([sys.executable, "-c", _HELP, command], capture_output=True, text=True, timeout=120,
                          cwd=away)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("command", ["core", "generate"])
def test_parsing_the_engine_flags_imports_no_web_framework(command, tmp_path):
    loaded = _modules_after_help(command, tmp_path)
    assert not [m for m in WEB_STACK if m in loaded], sorted(m for m in WEB_STACK if m in loaded)
    if command == "core":
        # torch (and its OpenMP team) loads only after the core pinned its CPUs; numpy is
        # imported by the public output types (logprob arrays), which `import pyengine` loads.
        assert "torch" not in loaded


def test_serve_help_still_has_the_engine_flags(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pyengine", "serve", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--max-num-seqs" in done.stdout and "--engine-transport" in done.stdout


def test_an_engine_core_process_loads_no_web_framework(tmp_path):
    """A core started by hand (as on another host) serves a request for a real front end
    and, when told to shut down, has loaded none of the web stack."""
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=7)
    input_port, output_port = free_ports(2)
    box: dict = {}
    link = LinkOptions(transport="tcp", input_port=input_port, output_port=output_port, local_cores=0,
                       start_timeout=120)
    thread = threading.Thread(target=lambda: box.update(engine=make_engine_client(
        EngineConfig(model=str(checkpoint), num_kv_blocks=64, max_num_seqs=4), multiprocess=True, link=link)),
        daemon=True)
    thread.start()
    report = tmp_path / "modules.json"
    core = subprocess.Popen([sys.executable, "-c", _CORE, str(report), str(checkpoint),
                             "--input", f"tcp://127.0.0.1:{input_port}", "--output", f"tcp://127.0.0.1:{output_port}",
                             "--num-kv-blocks", "64", "--max-num-seqs", "4"], stdin=subprocess.DEVNULL,
                            cwd=tmp_path)
    try:
        thread.join(150)
        engine = box.get("engine")
        assert engine is not None, "the front end never saw its core ready"
        try:
            async def one() -> list[int]:
                outs = [out async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=4,
                                                                                       ignore_eos=True))]
                return outs[-1].outputs[0].token_ids

            assert len(asyncio.run(asyncio.wait_for(one(), 120))) == 4
        finally:
            engine.shutdown()
        assert core.wait(60) == 0
    finally:
        if core.poll() is None:
            core.kill()
            core.wait(10)
        thread.join(10)
    loaded = set(json.loads(report.read_text()))
    assert "pyengine.engine.core" in loaded  # it really ran an engine
    assert not [m for m in WEB_STACK if m in loaded], sorted(m for m in WEB_STACK if m in loaded)
