"""Ranks launched from outside (``distributed_executor_backend="external_launcher"``):
torchrun, or any launcher that sets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``; the ranks may be on several hosts.

Every rank runs the same program (``pyengine serve``, ``pyengine generate``, or a script
building an ``LLM``) with the same engine arguments. Rank 0 becomes the engine: its
runner is returned and the engine starts as usual. Every other rank becomes a worker
inside that call: it serves rank 0's plans until rank 0 shuts down, then the process
exits (``SystemExit``), so it never returns to the program that built the engine.

Start-up: join the group (``init_method="env://"``, the launcher's store), create the
gloo group that carries the plans, load this rank's shard, then exchange every rank's
load status (an all-gather of a fixed-size text buffer): if any rank failed, every rank
stops with that rank's error. The plan goes out by broadcast (``broadcast_channel``).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Union

import torch

from pyengine.errors import InvalidConfigError, ModelLoadError
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.executor.tensor_parallel.broadcast_channel import (
    BroadcastPlanReceiver,
    BroadcastPlanSender,
    exit_barrier,
    plan_group,
)
from pyengine.executor.tensor_parallel.collective_step import decode_message, encode_message
from pyengine.executor.tensor_parallel.rendezvous import DEFAULT_TIMEOUT_S, from_environment
from pyengine.executor.tensor_parallel.runner import TensorParallelRunner
from pyengine.executor.tensor_parallel.worker import WorkerStep, serve_plans
from pyengine.models.architectures import check_tensor_parallel
from pyengine.models.loader import load_model, read_model_config
from pyengine.models.parallel import CollectiveError, ParallelContext

logger = logging.getLogger(__name__)


def join_external(path: Union[str, Path], config: ExecutorConfig, world_size: int) -> TensorParallelRunner:
    """Rank 0: the runner. Other ranks: serve, then ``SystemExit`` (see the module docstring)."""
    rendezvous = from_environment(os.environ, config.device)
    if rendezvous is None:
        raise InvalidConfigError(
            "distributed_executor_backend='external_launcher' needs the torchrun variables "
            "MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (run it under torchrun)"
        )
    if rendezvous.world_size != world_size:
        raise InvalidConfigError(
            f"tensor_parallel_size ({world_size}) must equal WORLD_SIZE ({rendezvous.world_size})"
        )
    check_tensor_parallel(read_model_config(path), world_size, config.enable_expert_parallel)
    device = rendezvous.device(config.device)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(
        rendezvous.backend, init_method="env://", rank=rendezvous.rank, world_size=world_size,
        timeout=timedelta(seconds=DEFAULT_TIMEOUT_S),
    )
    rank = rendezvous.rank
    try:
        group = plan_group()
        parallel = ParallelContext(rank, world_size, expert_parallel=config.enable_expert_parallel)
        error = ""
        try:
            loaded = load_model(path, dtype=config.dtype, device=device, load_format=config.load_format,
                                parallel=parallel, seed=config.seed, quantization=config.quantization)
        except Exception as failure:  # noqa: BLE001 - every rank learns it below
            error = f"{type(failure).__name__}: {failure}"
        failures = _exchange_status(error, world_size, group)
        if failures:
            raise ModelLoadError("; ".join(f"tensor-parallel rank {r} could not load its shard: {m}"
                                           for r, m in failures))
        executor_config = _on_device(config, device)
        if rank == 0:
            return TensorParallelRunner(loaded, executor_config, [], BroadcastPlanSender(group), None)
        runner = ModelRunner(loaded, executor_config)
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    code = _serve(runner, rank, group)
    raise SystemExit(code)


def _serve(runner: ModelRunner, rank: int, group: Any) -> int:
    receiver = BroadcastPlanReceiver(group)
    step = WorkerStep(runner, rank)
    try:
        serve_plans(receiver.receive, step.run)
        exit_barrier(group)
    except CollectiveError as error:
        logger.error("rank %d stops: %s", rank, error)
        return 1
    torch.distributed.destroy_process_group()
    return 0


def _exchange_status(error: str, world_size: int, group: Any) -> list[tuple[int, str]]:
    """Every rank's start-up error ("" when fine), on every rank."""
    mine = encode_message(error, failed=bool(error))
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    torch.distributed.all_gather(parts, mine, group=group)
    return [(rank, decode_message(part)) for rank, part in enumerate(parts) if float(part[0]) != 0.0]


def _on_device(config: ExecutorConfig, device: str) -> ExecutorConfig:
    import dataclasses

    return dataclasses.replace(config, device=device)

