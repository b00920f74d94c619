"""Rank 0 of a tensor-parallel group: the executor thread's runner, and the workers' parent.

Rank 0 lives in the engine's ``pyengine-exec`` thread: it is a :class:`ModelRunner` (the
persistent batch, the sampler, the row isolation of tensor-parallel size 1, unchanged)
whose forward pass also broadcasts the plan and joins the collectives. Keeping it there
saves a process hop per step (the plan is already in this thread, and the sampled ids
go straight back to the scheduler) and keeps one sampler, so sampling is done once, on
the full logits, exactly as at size 1. Ranks 1..N-1 are worker processes
(``worker``), started and reaped here.

Per step (``execute``; a plan without tokens runs on rank 0 alone): fill the plan's placeholders from the tokens sampled last step
(known here, on the host) -> write the plan into shared memory and wake every worker ->
the forward pass on every rank -> the vocabulary slices of the logits and every rank's
status gathered here -> sample. A rank whose step raised fails the step (its requests
end with the error naming the rank) and the engine goes on; a worker that died makes the
engine dead (``dead_reason``, and the failed collective) with its rank in the message.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from pyengine.errors import EngineDeadError, EngineError, InvalidConfigError, ModelLoadError
from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.attention.selector import resolve_block_size
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.kv_tables import model_kv_tables
from pyengine.executor.model_runner import ModelRunner, context_lens
from pyengine.executor.plan import StepPlanLike, last_sample_per_row
from pyengine.executor.prompt_logprobs import prompt_slices
from pyengine.executor.proposer_config import check_proposer_config
from pyengine.executor.runner_output import ModelRunnerOutput
from pyengine.executor.tensor_parallel.collective_step import (
    all_reduces_per_step,
    gather_logits,
    issue_owed_all_reduces,
    run_forward,
)
from pyengine.executor.tensor_parallel.host_collectives import HostCollectives
from pyengine.executor.tensor_parallel.plan_channel import (
    EXIT_BYTE,
    STEP_BYTE,
    PlanCapacity,
    PlanSegment,
    SharedMemoryPlanSender,
    StepPipeWriter,
    prompt_positions,
)
from pyengine.executor.tensor_parallel.rendezvous import (
    DEFAULT_TIMEOUT_S,
    Rendezvous,
    backend_for,
    cuda_base_index,
    forget_failed_join,
    host_store,
    join_group,
    leave_group,
)
from pyengine.models.architectures import check_tensor_parallel
from pyengine.models.loader import LoadedModel, load_model, read_model_config
from pyengine.models.parallel import CollectiveError, ParallelContext
from pyengine.processes.child_command import python_module_command

logger = logging.getLogger(__name__)


class RankStepError(EngineError, RuntimeError):
    """A step failed on one or more ranks (the step's requests end with this error)."""


class TokenlessPlanError(EngineError, ValueError):
    """A plan without tokens carries block-table writes: it cannot reach the workers
    (every published plan must end in a collective, see ``plan_channel``)."""


class WorkerProcess:
    """One worker rank: its process and the two pipes to it."""

    def __init__(self, rank: int, process: subprocess.Popen, signal_fd: int, reply_fd: int) -> None:
        self.rank = rank
        self.process = process
        self.signal = StepPipeWriter(signal_fd)
        self.reply = os.fdopen(reply_fd, "r")
        self._buffer = ""
        self._closed_pipe = False  # the worker's end of the reply pipe is closed (it exited)

    def send(self, byte: bytes) -> None:
        self.signal.send(byte)  # a worker that is gone: dead_reason reports it

    def receive(self, deadline: float) -> dict[str, Any]:
        """The worker's next start-up message; an error message when it dies or times out."""
        while True:
            if "\n" in self._buffer:
                line, self._buffer = self._buffer.split("\n", 1)
                return json.loads(line)
            if self._closed_pipe:
                return {"stage": "error", "error": self._exit_text()}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return {"stage": "error", "error": "did not answer in time"}
            self._read(min(remaining, 0.5))

    def failure_now(self) -> Optional[str]:
        """The error this worker reported, or its exit, if either happened already: reads
        what its reply pipe holds without waiting (other messages stay for ``receive``)."""
        while not self._closed_pipe and self._read(0.0):
            pass
        for line in self._buffer.split("\n")[:-1]:
            message = json.loads(line)
            if message.get("stage") == "error":
                return str(message.get("error"))
        if self._closed_pipe or self.process.poll() is not None:
            return self._exit_text()
        return None

    def _read(self, timeout: float) -> bool:
        """Whatever the reply pipe holds, waiting up to ``timeout`` for it: False when
        nothing came."""
        ready, _, _ = select.select([self.reply], [], [], timeout)
        if not ready:
            return False
        chunk = os.read(self.reply.fileno(), 65536).decode()
        if not chunk:
            self._closed_pipe = True
            return False
        self._buffer += chunk
        return True

    def _exit_text(self) -> str:
        try:
            return f"the process exited with code {self.process.wait(timeout=10)}"
        except subprocess.TimeoutExpired:
            return "the process closed its reply pipe but did not exit"

    def exit_code(self) -> Optional[int]:
        return self.process.poll()

    def stop(self, timeout: float) -> None:
        """Asks the worker to exit, then kills it if it does not, and reaps it."""
        self.send(EXIT_BYTE)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.signal.close()
        try:
            self.reply.close()
        except OSError:
            pass


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner (see the module docstring); build it with :func:`start`."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: ExecutorConfig,
        workers: list[WorkerProcess],
        channel: Any,
        store: Any,
    ) -> None:
        self.workers = workers  # the local worker processes (none when launched from outside)
        self.channel = channel  # SharedMemoryPlanSender or BroadcastPlanSender
        self.store = store
        self._out_of_step: Optional[str] = None  # why the ranks cannot be resynchronised
        self._published: Any = None  # the step's plan as the workers run it
        super().__init__(loaded, config)
        self.host_last_sampled = np.zeros(config.max_num_seqs, dtype=np.int64)
        # The plan broadcast's cost: wall time, and this thread's CPU time (the wall time
        # includes being descheduled when the host has fewer free cores than ranks).
        self.broadcast_seconds = 0.0
        self.broadcast_cpu_seconds = 0.0
        self.steps = 0
        self._closed = False
        self.threads_before = torch.get_num_threads()

    @property
    def world_size(self) -> int:
        return self.model.parallel.world_size

    def execute(self, plan: StepPlanLike, **kwargs: Any) -> ModelRunnerOutput:
        if self._out_of_step is not None:
            raise EngineDeadError(self._out_of_step)
        if not len(plan.input_ids):
            return self._execute_locally(plan, **kwargs)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        # With prompt logprobs, the workers compute logits for those positions too.
        published = self.prompt_logprobs.widen(plan)
        self._published = published
        self.channel.publish(published, self._filled_input_ids(plan))
        self.broadcast_seconds += time.perf_counter() - t0
        self.broadcast_cpu_seconds += time.thread_time() - cpu0
        self.steps += 1
        count = self.model.parallel.count
        count.reset()
        try:
            output = super().execute(plan, **kwargs)
        except CollectiveError as error:
            raise self._dead_error(error) from error
        except Exception as error:
            if count.gathers < gathers_per_step(published):  # the workers still wait for collectives
                self._fail_collectives(published, error)
            raise
        if len(plan.sample_rows):
            rows, tokens = last_sample_per_row(plan, output.sampled_token_ids, output.num_accepted)
            self.host_last_sampled[rows] = tokens
        return output

    def _execute_locally(self, plan: StepPlanLike, **kwargs: Any) -> ModelRunnerOutput:
        """A plan without tokens (rows freed or added, nothing to compute) runs on rank 0
        alone: published, it would end in no collective, and the next plan could then
        overwrite the shared segment before a worker has read it. The workers keep no row
        state but the block table, so only block-table writes would need them: such a plan
        is refused (the scheduler never makes one)."""
        if len(plan.block_table_rows):
            raise TokenlessPlanError(
                f"step {plan.step_id} has no tokens but {len(plan.block_table_rows)} block-table write(s): a "
                "tensor-parallel group takes block-table writes only with tokens to compute"
            )
        return super().execute(plan, **kwargs)

    def _filled_input_ids(self, plan: StepPlanLike) -> np.ndarray:
        """The plan's input ids with each placeholder replaced by its row's last sample."""
        ids = plan.input_ids
        if len(ids) == len(plan.rows) and len(ids) and ids.max() < 0:  # a pure decode step, all placeholders
            return self.host_last_sampled[plan.rows]
        holes = np.flatnonzero(ids < 0)
        if not holes.size:
            return ids
        owners = np.searchsorted(plan.query_start_loc, holes, side="right") - 1
        ids = ids.copy()
        ids[holes] = self.host_last_sampled[plan.rows[owners]]
        return ids

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepAttentionLayout,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits, _ = self._sharded_forward(input_ids, positions, layout, logits_indices, ())
        return hidden, logits

    def _forward_capturing(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepAttentionLayout,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-3's capture on rank 0: the residual stream entering a layer is whole on
        every rank (it is the sum of the all-reduced outputs), so rank 0 takes it from its
        own forward; the workers run their plain forward, with the same collectives."""
        assert self.eagle3 is not None  # only EAGLE-3 captures
        hidden, logits, aux = self._sharded_forward(input_ids, positions, layout, logits_indices,
                                                    self.eagle3.aux_layers)
        assert aux is not None  # aux_layers is not empty
        return hidden, logits, aux

    def _sharded_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepAttentionLayout,
        logits_indices: torch.Tensor, aux_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """This rank's forward, the logits gathered from every rank, and with ``aux_layers``
        the captured states (``DecoderForCausalLM.forward_capturing``)."""
        model = self.model
        captured: list[Optional[torch.Tensor]] = [None]

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            attention = self.attention_backend.bind(self.kv_cache, layout)
            lens = context_lens(model, layout)
            if aux_layers:
                hidden, captured[0] = model.forward_capturing(input_ids, positions, attention, lens, aux_layers)
            else:
                hidden = model(input_ids, positions, attention, lens)
            return hidden, model.local_logits(hidden.index_select(0, logits_indices))

        hidden, error, local = run_forward(
            model, forward, len(input_ids), len(logits_indices), self.device, self.loaded.dtype
        )
        gathered = gather_logits(model, local, error)
        if gathered.failures:
            failure = RankStepError(_reasons(gathered.failures))
            self._issue_owed_gathers(self._published, failure)  # the workers go on to the prompt slices
            raise failure from error
        assert hidden is not None and gathered.logits is not None
        return hidden, gathered.logits, captured[0]

    def _prompt_logits(self, hidden: torch.Tensor, token_indices: np.ndarray) -> torch.Tensor:
        """One slice of prompt positions: this rank's vocabulary slice, then the gather
        (a failure on any rank raises after the gather, so the ranks stay in step)."""
        model = self.model
        error: Optional[BaseException] = None
        try:
            index = torch.from_numpy(token_indices).to(self.device)
            local = model.local_logits(hidden.index_select(0, index))
        except Exception as failure:  # noqa: BLE001 - reported through the gather
            error = failure
            rows = model.parallel.vocab_rows(model.config.vocab_size)
            local = torch.zeros(len(token_indices), rows, device=self.device, dtype=torch.float32)
        gathered = gather_logits(model, local, error)
        if gathered.failures:
            raise RankStepError(_reasons(gathered.failures)) from error
        assert gathered.logits is not None
        return gathered.logits

    def _prompt_logits_abandoned(self, error: BaseException) -> None:
        self._issue_owed_gathers(self._published, error)

    def _issue_owed_gathers(self, plan: StepPlanLike, error: BaseException) -> None:
        """The step's gathers this rank has not done yet (the sampled rows', then one per
        prompt slice), with zeros and ``error``, as the workers expect them."""
        model = self.model
        rows = model.parallel.vocab_rows(model.config.vocab_size)
        for size in gather_sizes(plan)[model.parallel.count.gathers:]:
            gather_logits(model, torch.zeros(size, rows, device=self.device, dtype=torch.float32), error)

    def _fail_collectives(self, plan: StepPlanLike, error: BaseException) -> None:
        """This rank's step failed outside the forward pass's own recovery (before it, or
        in the gather's preparation): issue exactly the collectives the step still owes
        (the all-reduces with zeros, the gather with a failed status), so the workers
        finish the step too. When even that fails the ranks can no longer be known to be
        in step: the engine is dead rather than risk mismatched collectives."""
        model = self.model
        count = model.parallel.count
        try:
            issue_owed_all_reduces(model, len(plan.input_ids), self.device, self.loaded.dtype)
            self._issue_owed_gathers(plan, error)
        except CollectiveError as collective:
            raise self._dead_error(collective) from collective
        except Exception as failure:  # noqa: BLE001 - the group's state is unknown: stop it
            self._out_of_step = (
                f"tensor-parallel rank 0 could not finish step {plan.step_id}'s collectives after it failed "
                f"({count.all_reduces} of {all_reduces_per_step(model)} all-reduces, {count.gathers} of "
                f"{gathers_per_step(plan)} gathers done): the ranks are out of step ({type(failure).__name__}: {failure}; the step failed with "
                f"{type(error).__name__}: {error})"
            )
            raise EngineDeadError(self._out_of_step) from failure

    # ---- liveness and shutdown ----

    def dead_reason(self) -> Optional[str]:
        """Why the group can no longer run a step (a worker exited, the ranks fell out of
        step), or None."""
        if self._out_of_step is not None and not self._closed:
            return self._out_of_step
        for worker in self.workers:
            code = worker.exit_code()
            if code is not None and not self._closed:
                return f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) exited with code {code}"
        return None

    def _dead_error(self, error: BaseException) -> EngineDeadError:
        deadline = time.monotonic() + 5.0
        reason = self.dead_reason()
        while reason is None and time.monotonic() < deadline:  # the peer's exit may lag its socket
            time.sleep(0.05)
            reason = self.dead_reason()
        return EngineDeadError(reason or f"tensor-parallel collective failed: {error}")

    def close(self, timeout: float = 10.0) -> None:
        """Stops and reaps every worker, leaves the group, removes the shared segment."""
        if self._closed:
            return
        clean = self.dead_reason() is None
        self._closed = True
        try:
            self.channel.close(timeout_s=timeout)  # the workers' exit
        except CollectiveError:
            clean = False
        for worker in self.workers:
            worker.stop(timeout)
        if clean:
            leave_group(self.store, 0, self.world_size, timeout_s=timeout)
        elif torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if self.model.parallel.local is not None:
            self.model.parallel.local.close()
        torch.set_num_threads(self.threads_before)

    def stats(self) -> dict[str, float]:
        """Mean plan-broadcast time per step (seconds): wall and executor-thread CPU."""
        steps = max(1, self.steps)
        return {"broadcast_s_per_step": self.broadcast_seconds / steps,
                "broadcast_cpu_s_per_step": self.broadcast_cpu_seconds / steps, "steps": float(self.steps)}


def gather_sizes(plan: StepPlanLike) -> list[int]:
    """The rows of each of the step's logits gathers: the sampled rows', then each slice of
    its prompt positions'."""
    prompt = prompt_positions(plan)
    slices = prompt_slices(len(prompt), getattr(plan, "prompt_slice", 0)) if len(prompt) else []
    return [len(plan.logits_indices)] + [hi - lo for lo, hi in slices]


def gathers_per_step(plan: StepPlanLike) -> int:
    return len(gather_sizes(plan))


def _reasons(failures: dict[int, str]) -> str:
    return "; ".join(f"tensor-parallel rank {rank}: {text}" for rank, text in failures.items())


def plan_capacity(config: ExecutorConfig, max_model_len: int, num_tables: int = 1) -> PlanCapacity:
    """The largest plan of these limits; ``num_tables``: a hybrid model's per-group tables
    (``kv_tables.model_kv_tables``), each row's every table written at most once whole."""
    blocks_per_seq = -(-max_model_len // config.block_size)
    return PlanCapacity(
        max_tokens=config.max_num_batched_tokens,
        max_rows=config.max_num_seqs,
        max_block_writes=config.max_num_seqs * blocks_per_seq * num_tables,
        num_tables=num_tables,
    )


def start(
    path: Union[str, Path],
    config: ExecutorConfig,
    world_size: int,
    *,
    threads_per_rank: Optional[int] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    step_wrapper: Optional[str] = None,
    shared_memory_collectives: bool = True,
) -> TensorParallelRunner:
    """Starts workers 1..N-1 on this host, joins them as rank 0 and loads every shard.

    On the CPU the forward pass's all-reduces and the logits gather go through shared
    memory (``host_collectives``) unless ``shared_memory_collectives`` is False; gloo
    carries them then, and always carries the rest.

    A model whose sizes do not split ``world_size`` ways is refused before any process
    starts; a rank that cannot load its shard stops start-up with that rank's error; every
    started process is reaped whatever fails. ``step_wrapper`` ("module:function") wraps
    the workers' load and step, for fault-injection tests only.
    """
    model_config = read_model_config(path)
    check_tensor_parallel(model_config, world_size, config.enable_expert_parallel)
    check_devices(config.device, world_size)
    check_proposer_config(config.speculative_config, model_config)  # before the workers wait for it
    config = resolve_block_size(config)  # decided once, here: the workers get rank 0's
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    threads = threads_per_rank or max(1, torch.get_num_threads() // world_size)
    store = host_store("127.0.0.1", 0, world_size, timeout_s)
    rendezvous = Rendezvous("127.0.0.1", store.port, 0, world_size, 0, backend_for(config.device), timeout_s)
    tables = model_kv_tables(model_config)
    capacity = plan_capacity(config, max_model_len, 1 if tables is None else tables.num_tables)
    segment = PlanSegment(capacity, workers=world_size - 1)
    workers: list[WorkerProcess] = []
    threads_before = torch.get_num_threads()
    local: Optional[HostCollectives] = None
    try:
        if shared_memory_collectives and rendezvous.device(config.device) == "cpu":
            local = HostCollectives.create_or_none(world_size, timeout_s, reserved_bytes=segment.shm.size)
        for rank in range(1, world_size):
            workers.append(_spawn(rank, rendezvous, config, capacity, segment.name, local, path, threads,
                                  step_wrapper))
        deadline = time.monotonic() + timeout_s
        _expect(workers, "hello", deadline)
        torch.set_num_threads(threads)  # this process is rank 0: one share of the cores, like each worker
        _join_or_report(workers, rendezvous, store, rendezvous.device(config.device))
        parallel = ParallelContext(0, world_size, local=local, expert_parallel=config.enable_expert_parallel)
        try:
            loaded = load_model(path, dtype=config.dtype, device=rendezvous.device(config.device),
                                load_format=config.load_format, parallel=parallel, seed=config.seed,
                                quantization=config.quantization)
        except Exception as error:
            raise ModelLoadError(f"tensor-parallel rank 0 could not load its shard: {error}") from error
        _expect(workers, "loaded", time.monotonic() + timeout_s)
        for worker in workers:
            worker.send(STEP_BYTE)
        channel = SharedMemoryPlanSender(segment, [worker.send for worker in workers])
        try:
            runner = TensorParallelRunner(loaded, config, workers, channel, store)
        except Exception as error:  # a worker that failed first explains a failed collective here
            failure = _first_worker_failure(workers, time.monotonic() + 5.0)
            if failure is not None:
                raise failure from error
            raise
        runner.threads_before = threads_before
        _expect(workers, "ready", time.monotonic() + timeout_s)
        # Every rank has mapped both segments: their names go now, so that no exit, even
        # a killed process, leaves one behind.
        segment.unlink()
        if local is not None:
            local.unlink()
        logger.info("tensor parallel: %d ranks, %d thread(s) each, %s%s", world_size, threads, rendezvous.backend,
                    ", shared-memory all-reduce" if local is not None else "")
        return runner
    except BaseException:
        for worker in workers:
            worker.stop(timeout=5.0)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        segment.close()
        if local is not None:
            local.close()
        torch.set_num_threads(threads_before)
        raise


def check_devices(device: str, world_size: int, count: Optional[int] = None) -> None:
    """On CUDA, ranks 0..N-1 take devices ``base .. base + N - 1`` (``cuda:1`` with two
    ranks: 1 and 2): refuses before any process starts when there are not that many
    (``count``: the visible devices, ``torch.cuda.device_count()`` by default)."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if count is None else count
    base = cuda_base_index(device)
    if base + world_size > count:
        raise InvalidConfigError(
            f"tensor_parallel_size {world_size} from {device} needs devices {base}..{base + world_size - 1}, "
            f"but {count} CUDA device(s) are visible"
        )


def _first_worker_failure(workers: list[WorkerProcess], deadline: float) -> Optional[ModelLoadError]:
    """The start-up error a worker reported (or its exit) before ``deadline``, if any."""
    for worker in workers:
        message = worker.receive(deadline)
        if message.get("stage") == "error" and message.get("error") != "did not answer in time":
            return ModelLoadError(
                f"tensor-parallel rank {worker.rank} failed to start (runner): {message.get('error')}"
            )
    return None


def _join_or_report(workers: list[WorkerProcess], rendezvous: Rendezvous, store: Any, device: str) -> None:
    """Rank 0 joins the process group. When that fails (a worker that failed inside its own
    join leaves rank 0 waiting out the store's timeout), the workers' own errors, whose
    lines sit unread in their reply pipes, are read without waiting and raised first: they
    say why, the store's timeout does not."""
    try:
        join_group(rendezvous, store, device=device)
    except Exception as error:
        forget_failed_join()
        _raise_worker_failure(workers, "join", cause=error)
        raise ModelLoadError(f"tensor-parallel rank 0 could not join the process group: {error}") from error


def _raise_worker_failure(workers: list[WorkerProcess], stage: str, cause: Optional[BaseException] = None) -> None:
    for worker in workers:
        failure = worker.failure_now()
        if failure is not None:
            raise ModelLoadError(f"tensor-parallel rank {worker.rank} failed to start ({stage}): {failure}") from cause


def _expect(workers: list[WorkerProcess], stage: str, deadline: float) -> None:
    for worker in workers:
        message = worker.receive(deadline)
        if message.get("stage") != stage:
            error = message.get("error", message)
            raise ModelLoadError(f"tensor-parallel rank {worker.rank} failed to start ({stage}): {error}")


def _spawn(
    rank: int, rendezvous: Rendezvous, config: ExecutorConfig, capacity: PlanCapacity, segment: str,
    local: Optional[HostCollectives], path: Union[str, Path], threads: int, step_wrapper: Optional[str],
) -> WorkerProcess:
    signal_read, signal_write = os.pipe()
    reply_read, reply_write = os.pipe()
    spec = {
        "rank": rank,
        "world_size": rendezvous.world_size,
        "threads": threads,
        "signal_fd": signal_read,
        "reply_fd": reply_write,
        "rendezvous": {**asdict(rendezvous), "rank": rank, "local_rank": rank},
        # Workers never sample, so they take no logits processors (classes do not cross);
        # they keep speculative_config, loading no proposer (``ModelRunner._load_proposer``).
        "executor_config": asdict(replace(config, logits_processors=())),
        "capacity": asdict(capacity),
        "segment": segment,
        "collectives": None if local is None else {"name": local.name, "slot_bytes": local.slot_bytes},
        "model": str(path),
        "step_wrapper": step_wrapper,
    }
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:
        process = subprocess.Popen(
            python_module_command("pyengine.executor.tensor_parallel.worker", json.dumps(spec)),
            pass_fds=(signal_read, reply_write), env=env, stdin=subprocess.DEVNULL,
            start_new_session=True,  # out of the terminal's process group: Ctrl-C reaches rank 0 only
        )
    finally:
        os.close(signal_read)
        os.close(reply_write)
    return WorkerProcess(rank, process, signal_write, reply_read)
