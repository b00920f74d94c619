"""The front end's engine cores: what it knows of each, starting the local ones, waiting
for every core's ``Ready``, stopping and reaping them.

A core on this host is a child process (``processes.CoreProcessHandle``); one on another
host is known only by its messages (``pyengine core`` started there by hand). Either way
its ``CoreState`` carries its figures and, once it is gone, why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Optional

from pyengine.config import EngineConfig
from pyengine.errors import EngineError
from pyengine.multiprocess import wire
from pyengine.multiprocess.processes import CoreProcessHandle, cpu_shares, device_env
from pyengine.multiprocess.transport import FrontEndLink

POLL_MS = 100


class CoreState:
    """What the front end knows of one core (its fields change under the client's lock)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Optional[CoreProcessHandle] = None  # None for a core on another host
        self.info: Optional[wire.CoreInfo] = None
        self.outstanding = 0
        self.steps = 0
        self.num_unfinished = 0
        self.reported_dead: Optional[str] = None  # the core's own word (a thread died)
        self.dead: Optional[str] = None  # gone: its process exited, or it fell silent
        self.last_status = time.monotonic()


def check_local_cores(config: EngineConfig, transport: str, local_cores: Optional[int],
                      core_cpus: Optional[Sequence[int]]) -> list[Optional[list[int]]]:
    """Each local core's CPUs (``cpu_shares``), once the count and the device settings are
    known to work: a setting that cannot fails here, before any socket or process exists."""
    n = config.data_parallel_size
    local = n if local_cores is None else local_cores
    if not 0 <= local <= n or (transport == "ipc" and local != n):
        raise EngineError(f"local_cores = {local_cores}: between 0 and data_parallel_size = {n}, and all of "
                          "them with transport='ipc' (cores on other hosts need tcp)")
    shares = cpu_shares(local, core_cpus) if local else []
    for i in range(local):
        device_env(config, i)
    return shares


def start_local_cores(cores: list[CoreState], config: EngineConfig, link: FrontEndLink,
                      shares: list[Optional[list[int]]], heartbeat_timeout: float) -> None:
    """Starts cores ``0 .. len(shares) - 1`` on this host, connecting to ``link``."""
    for i, cpus in enumerate(shares):
        cores[i].process = CoreProcessHandle(config, i, link.local_address(link.input_address),
                                             link.local_address(link.output_address), cpus, heartbeat_timeout,
                                             link.ipc_dir)


def wait_ready(cores: list[CoreState], link: FrontEndLink, timeout: float,
               abandon: Optional[threading.Event]) -> None:
    """Every core's ``Ready`` (its ``CoreInfo`` kept); a ``LoadFailed`` (or a local core
    that exits first) raises its error, and so does a hello this front end cannot read or
    whose protocol version is not its own, or ``abandon`` set. Cores already ready get
    heartbeats meanwhile (another may load long)."""
    deadline = time.monotonic() + timeout
    waiting = {c.index for c in cores}
    exited_at: dict[int, float] = {}
    next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
    while waiting:
        if abandon is not None and abandon.is_set():
            raise EngineError(f"start-up abandoned while engine core(s) {sorted(waiting)} were not ready")
        hello = link.receive_hello(POLL_MS)
        if hello is not None:
            if hello.engine_index not in waiting:
                raise EngineError(f"engine core {hello.engine_index} said ready twice, or is not one of the "
                                  f"{len(cores)} cores (check --engine-index)")
            core = cores[hello.engine_index]
            first = next((c.info for c in cores if c.info is not None), None)
            if first is not None:
                check_same_model(first, hello.info, hello.engine_index)
            core.info, core.last_status = hello.info, time.monotonic()  # its load is not silence
            waiting.discard(hello.engine_index)
            continue
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + wire.HEARTBEAT_INTERVAL_S
            for core in cores:
                if core.index not in waiting:
                    link.send(core.index, wire.Heartbeat())
        for core in cores:
            if core.process is not None and core.index in waiting and core.process.exit_status() is not None:
                # Its LoadFailed, sent before it exited, may still be on its way.
                if now - exited_at.setdefault(core.index, now) > 1.0:
                    raise EngineError(f"{core.process.describe_exit()} before it was ready (see its log above)")
        if now > deadline:
            raise EngineError(f"engine core(s) {sorted(waiting)} not ready within {timeout:.0f}s")


# What requests are checked against: the front end builds every request once
# (``build_request``) with the first core's limits, and a core trusts that build.
_CHECKED_FIELDS = ("max_model_len", "max_request_tokens", "vocab_size", "max_logprobs", "eos_token_ids",
                   "tokenizer_json")


def check_same_model(first: wire.CoreInfo, info: wire.CoreInfo, engine_index: int) -> None:
    """An ``EngineError`` naming the field when a core's model limits differ from the first
    core's: a core started by hand (``pyengine core``) with another model, tokenizer or
    ``--max-model-len`` would otherwise receive requests checked against limits not its own."""
    for field in _CHECKED_FIELDS:
        if getattr(first, field) != getattr(info, field):
            shown = "the tokenizer" if field == "tokenizer_json" else f"{field} ({getattr(info, field)!r} against " \
                f"{getattr(first, field)!r})"
            raise EngineError(f"engine core {engine_index} differs from the first core in {shown}: every core "
                              "behind one front end must serve the same model with the same limits")


def stop_local_cores(cores: list[CoreState], deadline: float) -> None:
    """Waits until ``deadline`` (monotonic) for the local cores to exit (they were told
    to), kills those that did not; reaps them all."""
    for core in cores:
        if core.process is not None:
            core.process.stop(deadline - time.monotonic())


def kill_local_cores(cores: list[CoreState]) -> None:
    """A start-up that failed: kills and reaps whatever was started."""
    for core in cores:
        if core.process is not None:
            core.process.popen.kill()
            core.process.popen.wait(10.0)
