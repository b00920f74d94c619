"""A tensor-parallel worker process (ranks 1..N-1): ``python -m
pyengine.executor.tensor_parallel.worker SPEC_JSON``.

Start-up, each stage reported to rank 0 as one JSON line on the reply pipe: ``hello``
(about to join the group) -> join the process group -> load this rank's shard
(``loaded``, or ``error`` with the exception, and exit) -> wait for rank 0's go (every
rank loaded) -> build the runner (the KV cache size is agreed over the ranks) ->
``ready``. Then, per step: wake on the step pipe, read the plan from shared memory, apply
its block-table writes (into each of a hybrid model's per-group tables), run the forward pass and join the logits gather (see
``collective_step``). The worker samples nothing: rank 0 does, once, and fills the next
plan's placeholders itself. A closed step pipe (rank 0 gone) or the exit byte ends the
process; a failed collective (a peer gone) too. SIGINT and SIGTERM are ignored (the
process also runs in a session of its own): rank 0 alone decides when a worker stops.
Every start-up failure (joining the group, loading, building the runner) is reported
with this rank before the process exits; any exception while serving is logged with this
rank, and the process exits with code 1 (skipping the interpreter's teardown, always).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
from typing import Any, Callable, Optional

import torch

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner, context_lens
from pyengine.executor.prompt_logprobs import prompt_slices
from pyengine.executor.tensor_parallel.collective_step import gather_logits, run_forward
from pyengine.executor.tensor_parallel.host_collectives import HostCollectives
from pyengine.executor.tensor_parallel.plan_channel import (
    EXIT_BYTE,
    ForwardPlan,
    PlanCapacity,
    PlanSegment,
    SharedMemoryPlanReceiver,
    StepSignal,
)
from pyengine.executor.tensor_parallel.rendezvous import Rendezvous, join_group, leave_group
from pyengine.models.loader import load_model
from pyengine.models.parallel import CollectiveError, ParallelContext
from pyengine.processes.startup_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

#: A worker waits this long for rank 0's go after loading (rank 0 loads its own shard meanwhile).
GO_TIMEOUT_S = 600.0


class WorkerStep:
    """Runs one plan on this rank's shard (no sampling)."""

    def __init__(self, runner: ModelRunner, rank: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.rank = rank

    def run(self, plan: ForwardPlan) -> None:
        self.model.parallel.count.reset()
        num_tokens = len(plan.input_ids)  # never 0: rank 0 publishes only plans with tokens

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            self.runner.batch.write_block_tables(plan)  # type: ignore[arg-type]
            return self.forward(plan)

        runner = self.runner
        hidden, error, local = run_forward(
            self.model, forward, num_tokens, len(plan.logits_indices), runner.device, runner.loaded.dtype
        )
        if error is not None:
            logger.error("rank %d: step %d failed: %r", self.rank, plan.step_id, error)
        gather_logits(self.model, local, error)
        if len(plan.prompt_logits_indices):
            self.gather_prompt_slices(plan, hidden, error)

    def gather_prompt_slices(self, plan: ForwardPlan, hidden: Optional[torch.Tensor],
                             error: Optional[BaseException]) -> None:
        """One gather per slice of the plan's prompt positions, as rank 0 expects them
        (zeros with this rank's error after a failure, so the count always matches)."""
        device = self.runner.device
        width = self.model.parallel.vocab_rows(self.model.config.vocab_size)
        positions = plan.prompt_logits_indices
        for lo, hi in prompt_slices(len(positions), plan.prompt_slice):
            local = None
            if error is None and hidden is not None:
                try:
                    local = self.model.local_logits(hidden.index_select(0, torch.from_numpy(positions[lo:hi]).to(device)))
                except Exception as failure:  # noqa: BLE001 - reported through the gather; rank 0 fails the rows
                    logger.error("rank %d: step %d's prompt logits failed: %r", self.rank, plan.step_id, failure)
                    error = failure
            if local is None:
                local = torch.zeros(hi - lo, width, device=device, dtype=torch.float32)
            gather_logits(self.model, local, error)

    def forward(self, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor]:
        runner = self.runner
        device = runner.device
        rows = torch.from_numpy(plan.rows).to(device)
        input_ids = torch.from_numpy(plan.input_ids).to(device)
        positions = torch.from_numpy(plan.positions).to(device)
        layout = runner._layout(plan, rows)  # type: ignore[arg-type]
        attention = runner.attention_backend.bind(runner.kv_cache, layout)
        hidden = self.model(input_ids, positions, attention, context_lens(self.model, layout))
        indices = torch.from_numpy(plan.logits_indices).to(device)
        return hidden, self.model.local_logits(hidden.index_select(0, indices))


def _send(reply: Any, **message: Any) -> None:
    reply.write(json.dumps(message) + "\n")
    reply.flush()


def _hook(spec: dict[str, Any]) -> Optional[Callable[..., Any]]:
    """A fault-injection wrapper named by import path (tests only; None in production)."""
    path = spec.get("step_wrapper")
    if not path:
        return None
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def main(spec: dict[str, Any]) -> int:
    rank, world_size = spec["rank"], spec["world_size"]
    ignore_stop_signals()
    torch.set_num_threads(spec["threads"])
    reply = os.fdopen(spec["reply_fd"], "w")
    steps = StepSignal(spec["signal_fd"])
    rendezvous = Rendezvous(**spec["rendezvous"])
    config = ExecutorConfig(**spec["executor_config"])
    device = rendezvous.device(config.device)
    wrapper = _hook(spec)
    local: Optional[HostCollectives] = None
    try:  # everything that can fail before joining: rank 0 hears it instead of waiting in the join
        if wrapper is not None:
            wrapper("join", rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        if spec.get("collectives"):
            local = HostCollectives(rank, world_size, rendezvous.timeout_s, **spec["collectives"])
    except Exception as error:  # noqa: BLE001 - reported to rank 0, which stops start-up
        _send(reply, stage="error", error=f"preparing {device}: {type(error).__name__}: {error}")
        return 1
    _send(reply, stage="hello")
    try:
        if wrapper is not None:
            wrapper("group", rank)
        store = join_group(rendezvous, device=device)
    except Exception as error:  # noqa: BLE001 - reported to rank 0, which stops start-up
        _send(reply, stage="error", error=f"joining the process group: {type(error).__name__}: {error}")
        return 1
    parallel = ParallelContext(rank, world_size, local=local, expert_parallel=config.enable_expert_parallel)
    clean_exit = False
    try:
        try:
            if wrapper is not None:
                wrapper("load", rank)
            loaded = load_model(
                spec["model"], dtype=config.dtype, device=device,
                load_format=config.load_format, parallel=parallel, seed=config.seed, quantization=config.quantization,
            )
        except Exception as error:  # noqa: BLE001 - reported to rank 0, which stops start-up
            _send(reply, stage="error", error=f"{type(error).__name__}: {error}")
            return 1
        _send(reply, stage="loaded")
        if steps.wait(GO_TIMEOUT_S) in (None, b"", EXIT_BYTE):
            return 0
        try:
            if wrapper is not None:
                wrapper("runner", rank)
            runner = ModelRunner(loaded, _with_device(config, device))
            segment = PlanSegment(PlanCapacity(**spec["capacity"]), name=spec["segment"], workers=world_size - 1)
        except Exception as error:  # noqa: BLE001 - reported to rank 0, which stops start-up
            _send(reply, stage="error", error=f"{type(error).__name__}: {error}")
            return 1
        step = WorkerStep(runner, rank)
        run = step.run if wrapper is None else wrapper("step", rank, step.run)
        freeze_startup_heap()  # a rank stalled by a full GC pass stalls every rank's collectives
        _send(reply, stage="ready")
        serve_plans(SharedMemoryPlanReceiver(segment, steps, index=rank - 1).receive, run)
        clean_exit = True
        segment.close()
        return 0
    except CollectiveError as error:
        logger.error("rank %d stops: %s", rank, error)
        return 1
    finally:
        if clean_exit:
            leave_group(store, rank, world_size)
        if local is not None:
            local.close()


def ignore_stop_signals() -> None:
    """A worker outlives Ctrl-C and a SIGTERM sent to the whole process group or cgroup:
    rank 0 decides when it stops (the exit byte, or its step pipe closing when rank 0's
    process is gone), so that the engine's drain can still run steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def serve_plans(receive: Callable[[], Optional[ForwardPlan]], run: Callable[[ForwardPlan], None]) -> None:
    """Runs every plan ``receive`` gives until it gives None (told to exit)."""
    with torch.inference_mode():
        while True:
            plan = receive()
            if plan is None:
                return
            run(plan)


def _with_device(config: ExecutorConfig, device: str) -> ExecutorConfig:
    import dataclasses

    return dataclasses.replace(config, device=device)


def run_logged(spec_json: str) -> int:
    """``main``'s exit code; any exception that escapes it (a bug in the serving loop, not
    only a failed collective) is logged with this rank and gives 1, so that the process
    still leaves through ``os._exit`` below."""
    rank = "?"
    try:
        spec = json.loads(spec_json)
        rank = spec.get("rank", "?")
        return main(spec)
    except BaseException:  # noqa: BLE001 - logged; the exit code tells rank 0
        logger.exception("tensor-parallel rank %s failed while serving", rank)
        return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_code = run_logged(sys.argv[1])
    # Whatever happened, the interpreter's teardown is skipped, as the engine core does:
    # the teardown of torch can abort a rank (gloo's threads outlive
    # destroy_process_group() once a model runner was built, root cause open, and their
    # destruction at exit calls std::terminate).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
