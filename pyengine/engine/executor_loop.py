"""The ``pyengine-exec`` thread: takes plans, runs the model, hands back the results.

Per step: wait for a plan (GIL released) -> ``ModelRunner.execute`` (the parameters of
new sequences come in the plan) -> ``submit_result`` with the sampled ids and a
:class:`StepResult` (log-probabilities, pooled vectors), which the scheduler carries to
the output thread in that step's event. An exception in a step fails that step's
sequences (``fail_step``, the error travelling the same way) and the loop goes on: the
engine recovers for new requests. The thread touches nothing but the runner and the
scheduler handle.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from pyengine._kernels import release_openmp_workers
from pyengine._sched import SchedulerThread
from pyengine.engine.clock import StepTimes, ThreadClock
from pyengine.engine.step_result import StepResult
from pyengine.engine.thread_names import name_current_thread
from pyengine.errors import EngineDeadError
from pyengine.executor.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

EXEC_THREAD_NAME = "pyengine-exec"
# How long the thread waits for a plan before it looks again whether the engine went
# idle (and frees its OpenMP team, `_free_team`) while it holds a team; 0.5 s otherwise.
TEAM_IDLE_CHECK_S = 0.01
IDLE_WAIT_S = 0.5


class ExecutorLoop:
    """``runner`` is anything with ``execute(plan) -> ModelRunnerOutput`` (the model runner, a
    synthetic runner, a fault-injecting wrapper in tests); ``has_requests`` tells whether
    requests are live, to count pipeline bubbles."""

    def __init__(self, runner: Any, sched: SchedulerThread, has_requests: Callable[[], bool]) -> None:
        self.runner = runner
        self.sched = sched
        self.has_requests = has_requests
        self.clock = ThreadClock()
        self.started = threading.Event()  # set once the thread runs under its OS name
        self.native_id: Optional[int] = None
        self.step_times = StepTimes()
        self.stopping = threading.Event()
        self.fatal: Optional[BaseException] = None
        # Pipeline bubbles: waits for a plan that began and ended with requests live in
        # the engine (the executor idle while there was work).
        self.bubble_seconds = 0.0
        self.bubbles = 0
        # Whether this thread has run a step since it last freed its OpenMP team.
        self._holds_team = False

    def run(self) -> None:
        name_current_thread(EXEC_THREAD_NAME)
        self.clock.start()
        self.native_id = threading.get_native_id()
        self.started.set()
        try:
            while not self.stopping.is_set():
                pending = self.has_requests()
                if not pending and self._holds_team:
                    self._free_team()
                t0 = time.perf_counter()
                with self.clock.idle():
                    plan = self.sched.next_plan(timeout=TEAM_IDLE_CHECK_S if self._holds_team else IDLE_WAIT_S)
                if pending and self.has_requests():
                    self.bubble_seconds += time.perf_counter() - t0
                    self.bubbles += 1
                if plan is not None:
                    self._holds_team = True
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

    def _free_team(self) -> None:
        """Frees this thread's OpenMP workers while the engine has no requests: libgomp counts
        every thread's team, idle or not, and once they outnumber the CPUs it cuts the
        spin-wait of every team to about a hundred iterations, so an idle engine's team made
        another engine's in the same process sleep and wake around every operator (two
        ``LLM`` engines alive in one process on 2 cores: the one running decoded 3,200
        tokens/s against 5,300 alone). The next step starts the workers again."""
        release_openmp_workers()
        self._holds_team = False

    def _step(self, plan: Any) -> None:
        t0 = time.perf_counter()
        # Wall time only matters to new sequences (their first-scheduled time).
        started_at = time.time() if len(plan.new_seq_ids) else 0.0
        try:
            out = self.runner.execute(plan)
            if out.num_accepted is None and out.next_drafts is None:
                self.sched.submit_result(plan.step_id, out.sampled_token_ids, _result(plan, out, started_at))
            else:  # speculative decoding: accepted drafts, or drafts for the next step
                self.sched.submit_result(plan.step_id, out.sampled_token_ids, _result(plan, out, started_at),
                                         num_accepted=out.num_accepted, next_drafts=out.next_drafts)
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - the step's requests get the error
            logger.exception("step %d failed; its requests are ended with an error", plan.step_id)
            failed = StepResult(plan.step_id, started_at, plan.new_seq_ids, error=repr(e))
            self.sched.fail_step(plan.step_id, failed)
        self.step_times.add(time.perf_counter() - t0)


def _result(plan: Any, out: ModelRunnerOutput, started_at: float) -> Optional[StepResult]:
    """The step's result beyond the sampled ids, or None when it has nothing to carry (a
    steady decode step): nothing is built or moved through the channel then."""
    if not (len(plan.new_seq_ids) or out.logprobs is not None or out.pooled is not None or out.row_errors
            or out.prompt_logprobs is not None):
        return None
    pooled = out.pooled.float().cpu().numpy() if out.pooled is not None else None
    return StepResult(
        plan.step_id,
        started_at,
        plan.new_seq_ids,
        sampled_seq_ids=out.sampled_seq_ids,
        logprobs=out.logprobs,
        pooled_seq_ids=out.pooled_seq_ids,
        pooled=pooled,
        row_errors=out.row_errors,
        prompt_logprobs=out.prompt_logprobs,
    )
