"""Fault injection from outside the engine's hot loops, for tests.

:class:`FaultyRunner` wraps the executor's runner: it fails a chosen step or stalls while
``hang`` is set, and otherwise calls through, so the executor loop itself carries no test
hooks; while ``fail_masks`` is set, every step's grammar mask fails to arrive (what a
scheduler stall past the mask timeout looks like to the executor). :class:`FaultySink` is a request's sink that raises on a chosen delivery, which
exercises the output thread's failure path.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Optional

from pyengine.errors import StepResultError

#: A hung runner gives up after this long, so a test that forgets to clear ``hang``
#: cannot keep the engine's shutdown waiting forever.
MAX_HANG_SECONDS = 60.0


class FaultyRunner:
    """Calls through to ``runner`` except where told to fail or stall."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.hang = threading.Event()
        self.fail_masks = threading.Event()
        self._fail_in: Optional[int] = None
        self._lock = threading.Lock()

    def fail_after(self, steps: int) -> None:
        """Run ``steps - 1`` more steps normally, then raise in the next one."""
        with self._lock:
            self._fail_in = steps

    def execute(self, plan: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + MAX_HANG_SECONDS
        while self.hang.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            if self._fail_in is not None:
                self._fail_in -= 1
                if self._fail_in <= 0:
                    self._fail_in = None
                    raise RuntimeError(f"injected failure in step {plan.step_id}")
        if self.fail_masks.is_set() and getattr(plan, "grammar_mask", None) is not None:
            plan = PlanWithLostMask(plan)
        return self.runner.execute(plan, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class LostMask:
    """A grammar mask ticket whose mask never comes."""

    def take(self, timeout: float = 30.0) -> Any:
        raise StepResultError("injected: the grammar mask did not arrive in time")


class PlanWithLostMask:
    """``plan`` (read through) with a :class:`LostMask` for its grammar mask."""

    def __init__(self, plan: Any) -> None:
        self._plan = plan
        self.grammar_mask = LostMask()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)


def install_faulty_runner(core: Any) -> FaultyRunner:
    """Puts a :class:`FaultyRunner` around ``core``'s executor runner (once) and returns it."""
    runner = core.executor.runner
    if not isinstance(runner, FaultyRunner):
        runner = FaultyRunner(runner)
        core.executor.runner = runner
    return runner


class FaultySink:
    """Collects a request's outputs; raises on delivery number ``fail_on`` (1-based)."""

    def __init__(self, fail_on: int) -> None:
        self.fail_on = fail_on
        self.outputs: list[Any] = []
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def put(self, output: Any) -> None:
        if len(self.outputs) + 1 == self.fail_on:
            self.fail_on = 0
            raise RuntimeError("injected output failure")
        self.outputs.append(output)
        if getattr(output, "finished", False):
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


# ---- tensor-parallel workers (named by import path in ``tensor_parallel.runner.start``) ----

#: A prompt token that makes tensor-parallel rank 1 fail the step that carries it.
POISON_TOKEN = 497


def fail_rank1_load(stage: str, rank: int, step: Any = None) -> Any:
    """Rank 1 cannot load its shard."""
    if stage == "load" and rank == 1:
        raise OSError("injected: rank 1 cannot read its shard")
    return step


def fail_rank1_runner(stage: str, rank: int, step: Any = None) -> Any:
    """Rank 1 cannot build its runner (after every rank loaded its shard)."""
    if stage == "runner" and rank == 1:
        raise MemoryError("injected: rank 1 cannot allocate its KV cache")
    return step


def fail_rank1_join(stage: str, rank: int, step: Any = None) -> Any:
    """Rank 1 fails before joining the process group (e.g. its device is missing)."""
    if stage == "join" and rank == 1:
        raise RuntimeError("injected: rank 1 has no device")
    return step


def fail_rank1_in_group_join(stage: str, rank: int, step: Any = None) -> Any:
    """Rank 1 fails in the process group's join, after its hello (rank 0 is joining too)."""
    if stage == "group" and rank == 1:
        raise ConnectionError("injected: rank 1 cannot reach the rendezvous store")
    return step


def fail_rank1_on_poison(stage: str, rank: int, step: Any = None) -> Any:
    """Rank 1's step raises (before its forward pass) when the plan holds ``POISON_TOKEN``."""
    if stage != "step" or rank != 1:
        return step

    def run(plan: Any) -> None:
        if len(plan.input_ids) and (plan.input_ids == POISON_TOKEN).any():
            def fail() -> Any:
                raise RuntimeError("injected fault on rank 1")
            return _run_failing(step, plan, fail)
        return step(plan)

    return run


def fail_rank1_prompt_logits(stage: str, rank: int, step: Any = None) -> Any:
    """Rank 1's LM head raises (out of memory) on a step's prompt positions
    (prompt_logprobs), after the step's sampled rows went through it."""
    if stage != "step" or rank != 1:
        return step

    def run(plan: Any) -> None:
        if not len(plan.prompt_logits_indices):
            return step(plan)
        model = step.__self__.model
        head = model.local_logits
        calls: list[int] = []

        def sampled_rows_only(hidden: Any) -> Any:
            calls.append(len(hidden))
            if len(calls) > 1:
                raise MemoryError("injected: rank 1 out of memory on prompt logits")
            return head(hidden)

        model.local_logits = sampled_rows_only
        try:
            step(plan)
        finally:
            del model.local_logits  # the class's method again

    return run


def _run_failing(step: Any, plan: Any, fail: Any) -> None:
    """Runs the worker's step with its forward pass replaced by ``fail``."""
    owner = step.__self__
    forward = owner.forward
    owner.forward = lambda plan: fail()
    try:
        step(plan)
    finally:
        owner.forward = forward


#: A prompt token on which tensor-parallel rank 1's step raises past its own recovery.
ESCAPE_TOKEN = 499


def escape_rank1_step(stage: str, rank: int, step: Any = None) -> Any:
    """Rank 1's step raises an exception that is not a collective's, outside the forward
    pass's recovery, when the plan holds ``ESCAPE_TOKEN`` (a bug in the worker's loop)."""
    if stage != "step" or rank != 1:
        return step

    def run(plan: Any) -> None:
        if len(plan.input_ids) and (plan.input_ids == ESCAPE_TOKEN).any():
            raise LookupError("injected: rank 1's step loop broke")
        return step(plan)

    return run


#: A prompt token on which tensor-parallel rank 1 is killed in the middle of a step's
#: shared-memory all-reduces.
DIE_TOKEN = 498


def kill_rank1_in_all_reduce(stage: str, rank: int, step: Any = None) -> Any:
    """Rank 1 completes the first all-reduce of a step holding ``DIE_TOKEN``, then is
    killed (SIGKILL) before it arrives at the second, where rank 0 waits for it."""
    if stage != "step" or rank != 1:
        return step

    def run(plan: Any) -> None:
        if len(plan.input_ids) and (plan.input_ids == DIE_TOKEN).any():
            local = step.__self__.model.parallel.local
            reduce = local.all_reduce

            def reduce_then_die(tensor: Any) -> None:
                reduce(tensor)
                os.kill(os.getpid(), signal.SIGKILL)

            local.all_reduce = reduce_then_die
        return step(plan)

    return run
