"""Starting engine-core processes on this host, each with its share of the machine.

A core is ``pyengine core`` run with this interpreter (``core_main.py``) and the front
end's validated config as JSON: no pickling, and the command a user runs on another host
is the same one. On CPU, ``data_parallel_size`` cores split the CPUs they may use into
contiguous shares (affinity and torch threads); on CUDA core ``i`` sees only the ``i``-th
visible device."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import msgspec

from pyengine.config import EngineConfig
from pyengine.errors import InvalidConfigError
from pyengine.logits_processors.loading import qualified_name
from pyengine.processes.child_command import python_module_command


def config_json(config: EngineConfig) -> str:
    """The config's fields as JSON (paths as strings) for ``pyengine core --config-json``;
    custom logits processors as the qualified names the core imports them by."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["logits_processors"] = [qualified_name(spec) for spec in config.logits_processors]
    return msgspec.json.encode(fields, enc_hook=lambda v: str(v) if isinstance(v, Path) else repr(v)).decode()


def cpu_shares(n: int, cpus: Optional[Sequence[int]]) -> list[Optional[list[int]]]:
    """Each core's CPUs: ``cpus`` (default: this process's, when ``n > 1``) in ``n``
    contiguous shares; None (no pinning) for one core and no ``cpus``."""
    if cpus is None:
        if n == 1:
            return [None]
        cpus = sorted(os.sched_getaffinity(0))
    cpus = list(cpus)
    if len(cpus) < n:
        raise InvalidConfigError(f"data_parallel_size = {n} needs at least {n} CPUs, {len(cpus)} given ({cpus})")
    share, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        size = share + (1 if i < extra else 0)
        out.append(cpus[start:start + size])
        start += size
    return out


def device_env(config: EngineConfig, index: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for core ``index`` when several cores share CUDA devices."""
    if not config.device.startswith("cuda") or config.data_parallel_size == 1:
        return {}
    if config.device != "cuda":
        raise InvalidConfigError(f"device {config.device!r}: with data_parallel_size > 1 give device='cuda'; "
                                 "core i then runs on the i-th visible device")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d for d in visible.split(",") if d.strip()]
    else:
        import torch

        devices = [str(i) for i in range(torch.cuda.device_count())]
    if len(devices) < config.data_parallel_size:
        raise InvalidConfigError(f"data_parallel_size = {config.data_parallel_size} needs as many CUDA devices; "
                                 f"{len(devices)} visible")
    return {"CUDA_VISIBLE_DEVICES": devices[index]}


class CoreProcessHandle:
    """One local engine-core process; ``stop`` always reaps it."""

    def __init__(self, config: EngineConfig, index: int, input_address: str, output_address: str,
                 cpus: Optional[list[int]], heartbeat_timeout: float, ipc_dir: Optional[str]) -> None:
        self.index = index
        cmd = python_module_command("pyengine", "core", "--input", input_address, "--output", output_address,
                                    "--engine-index", str(index), "--parent-pid", str(os.getpid()),
                                    "--heartbeat-timeout", str(heartbeat_timeout), "--config-json", config_json(config))
        if cpus:
            cmd += ["--cpus", ",".join(map(str, cpus))]
        if ipc_dir:
            cmd += ["--ipc-dir", ipc_dir]
        env = {**os.environ, **device_env(config, index)}
        # A session of its own: a terminal's Ctrl-C reaches the front end only, which drains
        # its requests and then stops the cores (a core would otherwise die mid-stream).
        self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.pid = self.popen.pid

    def exit_status(self) -> Optional[int]:
        return self.popen.poll()

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float) -> None:
        """Waits ``timeout`` for the process to exit (it was told to), then kills it; reaps it."""
        if self.wait(max(0.0, timeout)) is None:
            self.popen.kill()
            self.popen.wait(10.0)

    def describe_exit(self) -> str:
        code = self.popen.returncode
        if code is None:
            return f"engine core {self.index} (pid {self.pid}) is running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"engine core {self.index} (pid {self.pid}) was killed by {name}"
        return f"engine core {self.index} (pid {self.pid}) exited with status {code}"
