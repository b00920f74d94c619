"""The ``pyengine-exec`` thread: takes plans, runs the model, hands back sampled ids.

Per step: wait for a plan (GIL released) -> look up parameters of new sequences ->
``ModelRunner.execute`` -> publish logprobs / pooled vectors for the output thread (only
when a request asked) -> ``submit_result``. An exception in a step fails that step's
sequences (``fail_step``) and the loop goes on: the engine recovers for new requests.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pyengine._sched import SchedulerThread
from pyengine.engine.clock import StepTimes, ThreadClock
from pyengine.engine.registry import SequenceRegistry
from pyengine.engine.thread_names import name_current_thread
from pyengine.errors import EngineDeadError
from pyengine.executor.model_runner import ModelRunner
from pyengine.executor.outputs import LogprobsOutput
from pyengine.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)

EXEC_THREAD_NAME = "pyengine-exec"


@dataclass
class StepExtras:
    """What the output thread needs from a step beyond the sampled ids."""

    sampled_seq_ids: np.ndarray
    logprobs: Optional[LogprobsOutput] = None
    pooled: Optional[dict[int, list[float]]] = None
    error: Optional[BaseException] = None


class ExecutorLoop:
    def __init__(
        self,
        runner: ModelRunner,
        sched: SchedulerThread,
        registry: SequenceRegistry,
        extras: dict[int, StepExtras],
        max_rows: int,
    ) -> None:
        self.runner = runner
        self.sched = sched
        self.registry = registry
        self.extras = extras
        self.clock = ThreadClock()
        self.started = threading.Event()  # set once the thread runs under its OS name
        self.native_id: Optional[int] = None
        self.step_times = StepTimes()
        self.stopping = threading.Event()
        self.fatal: Optional[BaseException] = None
        self.fail_at_step: Optional[int] = None  # test hook: raise in this step
        self.hang = threading.Event()  # test hook: stall the executor while set
        # Pipeline bubbles: waits for a plan that began and ended with requests live in
        # the engine (the executor idle while there was work).
        self.bubble_seconds = 0.0
        self.bubbles = 0
        self._row_seq = np.full(max_rows, -1, dtype=np.int64)

    def run(self) -> None:
        name_current_thread(EXEC_THREAD_NAME)
        self.clock.start()
        self.native_id = threading.get_native_id()
        self.started.set()
        try:
            while not self.stopping.is_set():
                pending = len(self.registry) > 0
                t0 = time.perf_counter()
                with self.clock.idle():
                    plan = self.sched.next_plan(timeout=0.5)
                if pending and len(self.registry) > 0:
                    self.bubble_seconds += time.perf_counter() - t0
                    self.bubbles += 1
                if plan is not None:
                    self._step(plan)
        except EngineDeadError as e:
            if not self.stopping.is_set():
                self.fatal = e
                logger.error("executor stops: %s", e)
        except BaseException as e:  # noqa: BLE001 - recorded and reported by the engine
            self.fatal = e
            logger.exception("executor thread died")
        finally:
            self.clock.stop()

    def _new_params(self, plan) -> dict:
        """Parameters of the plan's new sequences. Sequences whose request is already gone
        (failed or aborted after this plan was made) get inert stand-ins: their results
        are dropped, and the rest of the step must not fail because of them."""
        seq_ids = plan.new_seq_ids.tolist()
        params = self.registry.params_for(seq_ids)
        self.registry.mark_scheduled(seq_ids, time.time())
        if len(params) < len(seq_ids):
            pooling_rows = set(plan.rows[plan.pool_indices].tolist())
            for seq, row in zip(seq_ids, plan.new_rows.tolist()):
                if seq not in params:
                    params[seq] = PoolingParams() if row in pooling_rows else SamplingParams(max_tokens=1)
        return params

    def _step(self, plan) -> None:
        t0 = time.perf_counter()
        if plan.new_rows.size:
            self._row_seq[plan.new_rows] = plan.new_seq_ids.astype(np.int64)
        try:
            if self.fail_at_step is not None and plan.step_id >= self.fail_at_step:
                self.fail_at_step = None
                raise RuntimeError(f"injected failure in step {plan.step_id}")
            while self.hang.is_set() and not self.stopping.is_set():
                time.sleep(0.01)
            params = self._new_params(plan) if plan.new_seq_ids.size else {}
            out = self.runner.execute(plan, params)
            if out.logprobs is not None or out.pooled is not None:
                pooled = None
                if out.pooled is not None:
                    seqs = self._row_seq[plan.rows[plan.pool_indices]]
                    pooled = dict(zip(seqs.tolist(), out.pooled.float().cpu().tolist()))
                self.extras[plan.step_id] = StepExtras(self._row_seq[plan.sample_rows], out.logprobs, pooled)
            self.sched.submit_result(plan.step_id, out.sampled_token_ids)
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - the step's requests get the error
            logger.exception("step %d failed; its requests are ended with an error", plan.step_id)
            self.extras[plan.step_id] = StepExtras(np.zeros(0, dtype=np.int64), error=e)
            self.sched.fail_step(plan.step_id)
        self.step_times.add(time.perf_counter() - t0)
