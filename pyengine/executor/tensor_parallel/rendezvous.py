"""How the ranks of a tensor-parallel group find each other: torch.distributed's TCP store.

Rank 0 (the engine's executor) hosts the store; each rank connects to it with its rank
and the world size, then joins the process group: gloo on CPU; on CUDA NCCL for device
tensors and gloo for host tensors (``"cpu:gloo,cuda:nccl"``: a few collectives, such as
agreeing on the KV cache size, run on host tensors, which an NCCL-only group refuses). On one
host the engine picks a free loopback port itself. Across hosts the usual torchrun
variables say where the store is (``MASTER_ADDR``, ``MASTER_PORT``) and who a process is
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); they are read once, here, into a
:class:`Rendezvous`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch

from pyengine.errors import InvalidConfigError

#: How long joining the group (and, after it, any collective) may wait for a peer.
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the TCP store is and who this process is in the group."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int
    backend: str  # "gloo", or "cpu:gloo,cuda:nccl" on CUDA (``backend_for``)
    timeout_s: float = DEFAULT_TIMEOUT_S

    def device(self, device: str) -> str:
        """This rank's device: on CUDA the configured device's index plus ``local_rank``
        (``cuda:1`` with two ranks: ``cuda:1`` and ``cuda:2``), the CPU otherwise."""
        if not device.startswith("cuda"):
            return "cpu"
        return f"cuda:{cuda_base_index(device) + self.local_rank}"


def cuda_base_index(device: str) -> int:
    """The index of ``cuda[:N]`` (0 for plain ``cuda``)."""
    _, _, index = device.partition(":")
    return int(index) if index else 0


def backend_for(device: str) -> str:
    """The process-group backend for ``device``: gloo on the CPU; on CUDA NCCL for CUDA
    tensors plus gloo for host tensors, so host-side collectives work there too."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def from_environment(environ: Mapping[str, str], device: str) -> Optional[Rendezvous]:
    """The torchrun variables, when ``MASTER_ADDR`` and ``RANK`` are set (else None)."""
    if "MASTER_ADDR" not in environ or "RANK" not in environ:
        return None
    try:
        rank = int(environ["RANK"])
        return Rendezvous(
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ.get("MASTER_PORT", "29500")),
            rank=rank,
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", rank)),
            backend=backend_for(device),
        )
    except (KeyError, ValueError) as error:
        raise InvalidConfigError(f"torchrun variables MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE: {error}") from error


def host_store(addr: str, port: int, world_size: int, timeout_s: float) -> torch.distributed.TCPStore:
    """Rank 0's store (port 0: a free port, read back from ``store.port``)."""
    return torch.distributed.TCPStore(
        addr, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_group(
    rendezvous: Rendezvous, store: Optional[torch.distributed.Store] = None, device: str = "cpu"
) -> torch.distributed.Store:
    """Joins the default process group (through ``store``, else the store at
    ``master_addr:master_port``, which rank 0 hosts); ``device``: this rank's device
    (``Rendezvous.device``), made current on CUDA."""
    timeout = timedelta(seconds=rendezvous.timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(
            rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size,
            is_master=rendezvous.rank == 0, timeout=timeout,
        )
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(
        rendezvous.backend, store=store, rank=rendezvous.rank, world_size=rendezvous.world_size, timeout=timeout
    )
    return store


def forget_failed_join() -> None:
    """After a join that raised: torch names the default group from a process-wide counter
    (``_world.group_count``), which ``init_process_group`` advances before it can fail and
    only ``destroy_process_group`` resets. Left at 1, this process's next group would be
    named differently from its fresh workers' and their rendezvous would never meet (the
    next start-up waits out the store's timeout), so it is reset here: no group exists."""
    if torch.distributed.is_initialized():
        return
    world = getattr(torch.distributed.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def leave_group(store: Optional[torch.distributed.Store], rank: int, world_size: int, timeout_s: float = 30.0) -> None:
    """Leaves the group in order: every rank destroys its group, then says so through the
    store, and rank 0 (which hosts the store) waits for all of them before it goes, so that
    no rank loses the store while still tearing down."""
    if not torch.distributed.is_initialized():
        return
    torch.distributed.destroy_process_group()
    if store is None or world_size == 1:
        return
    if rank != 0:
        store.set(f"pyengine/left/{rank}", "1")
        return
    try:
        store.wait([f"pyengine/left/{r}" for r in range(1, world_size)], timedelta(seconds=timeout_s))
    except RuntimeError:  # a rank that died leaves no key: nothing left to wait for
        pass


def default_environ() -> Mapping[str, str]:
    return os.environ
