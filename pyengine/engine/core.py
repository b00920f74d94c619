"""EngineCore: the three threads and the calls that feed them.

``pyengine-sched`` (Rust) plans, ``pyengine-exec`` runs the model, ``pyengine-output``
turns tokens into text and delivers outputs to sinks. Callers add requests with a sink
(a collector for ``LLM.generate``, an asyncio queue for ``AsyncEngine``) and may abort.

Failure policy: an exception in one step fails that step's requests and the engine goes
on serving new ones; if a thread dies (the scheduler panics, the executor or the output
thread hits an unexpected error) the engine is dead: every waiting caller gets
``EngineDeadError`` and new requests are refused with it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from pyengine._kernels import release_openmp_workers
from pyengine._sched import THREAD_NAME as SCHED_THREAD_NAME
from pyengine._sched import Request, SchedulerThread
from pyengine.config import EngineConfig
from pyengine.engine.checkpoint_extras import engine_tokenizer, sampling_defaults
from pyengine.engine.executor_loop import EXEC_THREAD_NAME, ExecutorLoop
from pyengine.engine.grammar import ConstraintCompiler
from pyengine.engine.output_loop import OUTPUT_THREAD_NAME, OutputLoop
from pyengine.engine.request_state import OutputKind, OutputSink, RequestState
from pyengine.engine.request_table import RequestTable
from pyengine.errors import DuplicateRequestError, EngineDeadError, InvalidConfigError, InvalidRequestError
from pyengine.executor.model_runner import ModelRunner
from pyengine.inputs.request_checks import (
    BuiltRequest,
    RequestLimits,
    build_request,
    check_some_token_allowed,
    executor_params,
    own_cache_salt,
)
from pyengine.logits_processors.bad_words_tokens import bad_words_token_ids
from pyengine.logits_processors.loading import resolve_processor, validate_request
from pyengine.outputs import EngineStats, ThreadStack
from pyengine.sampling_params import PoolingParams, SamplingParams, sample_params
from pyengine.text import DecodeTable, TextStream, TokenPieces
from pyengine.text.encode import encode_ids

if TYPE_CHECKING:
    from pyengine.kv_events.publisher import KvEventPublisher

logger = logging.getLogger(__name__)


def _load_runner(path: Path, config: EngineConfig) -> ModelRunner:
    """The model runner: in this thread at tensor-parallel size 1, else rank 0 of a group
    whose other ranks are worker processes started here."""
    if config.distributed_executor_backend == "external_launcher":  # a non-zero rank never returns
        from pyengine.executor.tensor_parallel.external import join_external

        return join_external(path, config.executor_config(), config.tensor_parallel_size)
    if config.tensor_parallel_size == 1:
        return ModelRunner.from_pretrained(path, config.executor_config())
    from pyengine.executor.tensor_parallel.runner import start

    return start(path, config.executor_config(), config.tensor_parallel_size,
                 shared_memory_collectives=not config.disable_custom_all_reduce)


def resolve_model_path(config: EngineConfig) -> Path:
    if config.model is not None:
        return Path(config.model)
    from pyengine.models.default_model import default_tiny_model

    return default_tiny_model()


class EngineCore:
    """The engine: see the module docstring. ``runner`` replaces the model runner (a
    synthetic executor for benchmarks and tests); by default it is loaded from
    ``config.model``."""

    def __init__(self, config: EngineConfig, runner: Optional[Any] = None,
                 after_event: Callable[[], None] = lambda: None, data_parallel_rank: int = 0) -> None:
        """``after_event`` runs on the output thread after each step's outputs went to
        their sinks (an engine-core process sends them then, as one message).
        ``data_parallel_rank``: this core's index among a front end's cores (its KV-event
        endpoints are offset by it, and its batches carry it)."""
        if config.data_parallel_size != 1:
            raise InvalidConfigError(
                f"data_parallel_size = {config.data_parallel_size} runs one engine core per process: use "
                "make_engine_client(config, multiprocess=True) or `pyengine serve`, not an in-process engine"
            )
        self.config = config
        # Custom logits processors: imported before the model loads, so a bad name fails fast.
        self.processor_classes = [resolve_processor(spec) for spec in config.logits_processors]
        self.model_path = resolve_model_path(config) if runner is None else Path("<synthetic>")
        self.runner = runner or _load_runner(self.model_path, config)
        self.kv_publisher: Optional["KvEventPublisher"] = None
        try:  # whatever fails from here, the runner (tensor-parallel workers, shm) is closed
            model_config = getattr(self.runner.loaded, "config", None)
            self.vocab_size: Optional[int] = getattr(model_config, "vocab_size", None)
            # The model's tokenizer or tokenizer='s; the sampling defaults generation_config= asks for.
            files = engine_tokenizer(config, self.model_path, self.runner.loaded, self.vocab_size)
            self.tokenizer, self.tokenizer_path, self._tokenizer_config = files.tokenizer, files.folder, \
                files.tokenizer_config
            self.generation_defaults = sampling_defaults(config, self.runner.loaded)
            # Token id -> bytes, built once and shared by every sequence's text stream.
            self.decode_table = DecodeTable.from_tokenizer(self.tokenizer) if self.tokenizer is not None else None
            self.eos_token_ids = list(self.runner.loaded.eos_token_ids)
            self.max_model_len = self.runner.max_model_len
            # Tokens per KV block: config.block_size, or the platform default the runner chose.
            self.block_size: int = self.runner.block_size
            # What one request can hold: max_model_len, or the whole KV pool when that is
            # smaller (the scheduler refuses a request needing more blocks than the pool has).
            # (A hybrid model's per-group tables each hold the whole length: a share each.)
            tables = getattr(self.runner, "num_kv_tables", 1)
            self.max_request_tokens = min(self.max_model_len, self.runner.num_kv_blocks // tables * self.block_size)
            # The vocabulary goes to Rust once, for structured outputs (docs/structured_outputs.md).
            self.constraints = ConstraintCompiler.for_engine(self.decode_table, self.eos_token_ids, self.vocab_size)
            # The layers by attention need: with every one windowed, the scheduler frees blocks
            # behind the window (a stand-in runner that does not say keeps every block).
            kv_groups = getattr(self.runner, "kv_groups", ())
            group_tables = getattr(self.runner, "group_tables", False)
            self.sched = SchedulerThread(
                config.scheduler_config(
                    self.runner.num_kv_blocks, self.block_size, self.max_model_len, kv_groups, group_tables
                )
            )
            self.requests = RequestTable()
            self.executor = ExecutorLoop(self.runner, self.sched, lambda: len(self.requests) > 0)
            # A token's text on its own (``Logprob.decoded_token``); None without a tokenizer.
            self.token_pieces = TokenPieces(self.tokenizer) if self.tokenizer is not None else None
            kv_events = config.kv_events
            if kv_events is not None and kv_events.active:
                from pyengine.kv_events.publisher import KvEventPublisher  # zmq: only when asked for

                medium = "GPU" if str(config.device).startswith("cuda") else "CPU"
                self.kv_publisher = KvEventPublisher(kv_events, self.block_size, medium, data_parallel_rank)
            self.output = OutputLoop(self.sched, self.requests, lambda: self.executor.fatal, after_event,
                                     self.kv_publisher)
            self._exec_thread = threading.Thread(target=self.executor.run, name=EXEC_THREAD_NAME, daemon=True)
            self._output_thread = threading.Thread(target=self.output.run, name=OUTPUT_THREAD_NAME, daemon=True)
        except BaseException:
            if self.kv_publisher is not None:
                self.kv_publisher.close()
            close_runner = getattr(self.runner, "close", None)
            if close_runner is not None:
                close_runner()
            raise
        self._closed = False
        self._exec_thread.start()
        self._output_thread.start()
        self.executor.started.wait()
        self.output.started.wait()
        release_openmp_workers()  # loading left this thread an idle OpenMP team: see add_request
        logger.info(
            "engine ready: %s, %d KV blocks, depth %d", self.model_path, self.runner.num_kv_blocks, config.pipeline_depth
        )

    # ---- requests ----

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json: pass token ids instead of text")
        return encode_ids(self.tokenizer, text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def limits(self) -> RequestLimits:
        """What ``build_request`` checks requests against."""
        return RequestLimits(self.vocab_size, self.config.max_logprobs, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: Union[SamplingParams, PoolingParams],
        sink: OutputSink,
        kind: OutputKind = "cumulative",
        priority: int = 0,
        fit_to_length: bool = False,
        make_text: bool = True,
    ) -> None:
        """Builds (``build_request``: checked against the model's limits, the parameters
        copied, the prompt truncated as asked) and queues a request; its outputs go to
        ``sink``. Raises ``InvalidRequestError`` for a request that can never be served and
        ``EngineDeadError`` once the engine is dead. See ``submit`` for the options."""
        self._check_alive()
        request = build_request(prompt, prompt_token_ids, params, self.limits)
        self.submit(request_id, request, sink, kind, priority, fit_to_length, make_text)

    def submit(self, request_id: str, request: BuiltRequest, sink: OutputSink, kind: OutputKind = "cumulative",
               priority: int = 0, fit_to_length: bool = False, make_text: bool = True) -> None:
        """Queues a request already built by ``build_request`` (here, or by the front end of
        an engine core in another process), after the checks only the engine can make.

        ``fit_to_length`` (the offline API, as vLLM's): a prompt that fits but whose
        ``max_tokens`` would not is generated up to the limit and ends with "length"
        instead of being refused; a prompt alone over the limit is still refused.

        ``make_text=False`` (an engine core whose front end detokenizes): the outputs carry
        token ids and no text, which saves the engine's CPU the per-token decoding. Only for
        a request without stop strings: finding those needs the text here."""
        self._check_alive()
        # An idle OpenMP team on the calling thread (from its own PyTorch work) makes libgomp
        # throttle the executor thread's team; freeing it costs nothing when there is none.
        release_openmp_workers()
        params = request.params
        if isinstance(params, SamplingParams):
            native = self._generation_request(request_id, request, params, priority, fit_to_length)
            if params.num_candidates > params.n:  # best_of: the final output only, once the best are known
                kind = "final"
            if not make_text and params.stop_strings:
                raise InvalidRequestError("stop strings need the text in the engine: make_text=False cannot be used")
        else:
            native = Request(request_id, request.prompt_token_ids, max_tokens=1, priority=priority, pooling=True,
                             sample_params=[params])
        # Built before taking the lock (text streams cost something); the lock only covers
        # the scheduler's numbering and the registration, which the output thread waits for.
        state = self._request_state(request_id, request, sink, kind, make_text)
        with self.requests.lock:
            self._check_alive()  # again, under the lock the output thread's fail-all takes
            if self.requests.contains_request(request_id):
                raise DuplicateRequestError(f"request id {request_id!r} is still in use")
            state.number_samples(self.sched.add_request(native))
            self.requests.add(state)

    def _generation_request(self, request_id: str, request: BuiltRequest, params: SamplingParams, priority: int,
                            fit_to_length: bool) -> Request:
        """The scheduler's request: the engine's own checks (bad words, custom processors, a
        token left to sample, the constraint compiled), then its stop criteria and per-sample
        parameters."""
        self._prepare_processor_fields(params)
        check_some_token_allowed(params, self.eos_token_ids)
        so = params.structured_outputs
        constraint = self.constraints.compile(so) if so is not None else None
        ids = request.prompt_token_ids
        max_tokens = params.max_tokens
        room = self.max_request_tokens - len(ids)
        if max_tokens is None:
            max_tokens = max(1, room)
        elif fit_to_length and 0 < room < max_tokens:
            max_tokens = room
        candidates = params.num_candidates
        for_executor = executor_params(params)  # once: a copy for best_of, validated again
        return Request(
            request_id, ids, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens),
            eos_token_ids=[] if params.ignore_eos else self.eos_token_ids, ignore_eos=params.ignore_eos,
            stop_token_ids=list(params.stop_token_ids or []), priority=priority, n=candidates,
            sample_params=[sample_params(for_executor, i) for i in range(candidates)],
            constraint=constraint, cache_salt=own_cache_salt(request_id, params),
            no_spec=self._refuses_drafts(params),
        )

    def _refuses_drafts(self, params: SamplingParams) -> bool:
        """Whether the executor would refuse every draft of this request (its logits
        processors follow its output: ``min_tokens``, ``bad_words``, or any custom
        processor, ``LogitsPipeline.follows_output``): the scheduler then never proposes
        for it, and it keeps the pipeline overlap."""
        return bool(self.processor_classes) or params.min_tokens > 0 or bool(params._bad_words_token_ids)

    def _request_state(self, request_id: str, request: BuiltRequest, sink: OutputSink, kind: OutputKind,
                       make_text: bool) -> RequestState:
        """The output thread's record of the request, with a text stream when its text is
        made as it streams (not only at the end, and not by a front end)."""
        params = request.params
        sampling = isinstance(params, SamplingParams)
        detokenize = sampling and params.detokenize  # type: ignore[union-attr]
        needs_stream = (make_text and detokenize and self.tokenizer is not None
                        and (kind != "final" or bool(params.stop_strings)))  # type: ignore[union-attr]
        return RequestState(request_id, request.prompt, list(request.prompt_token_ids), params, sink, kind,
                            self.decode if make_text else None, self._text_stream if needs_stream else None,
                            self.token_pieces if detokenize else None)

    def _prepare_processor_fields(self, params: SamplingParams) -> None:
        """Tokenizes ``bad_words`` into the copy's ``_bad_words_token_ids`` and runs the
        custom logits processors' ``validate_params`` (``InvalidRequestError`` if refused)."""
        if params.bad_words:
            if self.tokenizer is None or self.vocab_size is None:
                raise InvalidRequestError("bad_words needs the checkpoint's tokenizer (tokenizer.json), which it lacks")
            params._bad_words_token_ids = bad_words_token_ids(self.tokenizer, list(params.bad_words), self.vocab_size)
        validate_request(self.processor_classes, params)

    def compile_structured_outputs(self, params: SamplingParams) -> None:
        """Compiles the request's constraint into the cache (``InvalidRequestError`` when it
        is invalid), so that ``add_request`` finds it there: ``AsyncEngine`` calls this in a
        worker thread, keeping compilation off the event loop."""
        if params.structured_outputs is not None:
            self.constraints.compile(params.structured_outputs)

    def _text_stream(self, prompt_token_ids: list[int], params: SamplingParams) -> TextStream:
        return TextStream.from_sampling_params(self.decode_table, prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        """Aborts a request at any stage; its sink receives a final output with
        ``finish_reason == "abort"``. Unknown or finished ids are ignored."""
        if self._closed:
            return
        try:
            self.sched.abort(request_id)
        except EngineDeadError:
            pass  # nothing runs any more; its caller gets EngineDeadError from its sink

    # ---- health and stats ----

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        cause = self.dead_reason()
        if cause is not None:
            raise EngineDeadError(cause)

    def dead_reason(self) -> Optional[str]:
        """Why the engine can no longer serve, or None while it can. A death's own cause
        comes first; a shut-down engine says so (its scheduler thread stops as part of it)."""
        if not self.sched.is_alive and self.sched.death:
            return self.sched.death
        if self.executor.fatal is not None:
            return f"the executor thread died: {self.executor.fatal!r}"
        if self.output.fatal is not None:
            return f"the output thread died: {self.output.fatal!r}"
        runner_dead = getattr(self.runner, "dead_reason", None)  # tensor-parallel workers
        runner_reason = runner_dead() if runner_dead is not None else None
        if runner_reason is not None:
            return runner_reason
        if self._closed:
            return "the engine was shut down"
        if not self.sched.is_alive:
            return "the scheduler thread stopped"
        return None

    @property
    def is_alive(self) -> bool:
        return not self._closed and self.dead_reason() is None

    def num_unfinished(self) -> int:
        return len(self.requests)

    def stats(self) -> EngineStats:
        s = dict(self.sched.stats())
        exec_busy, exec_idle = self.executor.clock.busy_idle()
        out_busy, out_idle = self.output.clock.busy_idle()
        mean_ms, p99_ms = self.executor.step_times.mean_p99_ms()
        queried = s["prefix_cache_queried_tokens"]
        return EngineStats(
            threads={
                SCHED_THREAD_NAME: {"busy_s": s["sched_busy_seconds"], "idle_s": s["sched_idle_seconds"]},
                EXEC_THREAD_NAME: {"busy_s": exec_busy, "idle_s": exec_idle},
                OUTPUT_THREAD_NAME: {"busy_s": out_busy, "idle_s": out_idle},
            },
            steps=self.executor.step_times.count,
            step_time_mean_ms=mean_ms,
            step_time_p99_ms=p99_ms,
            num_running=int(s["num_running"]),
            num_waiting=int(s["num_waiting"]),
            num_preempted_waiting=int(s["num_preempted_waiting"]),
            preemptions=int(s["preemptions"]),
            kv_usage=float(s["kv_usage"]),
            kv_blocks_total=int(s["kv_blocks_total"]),
            prefix_cache_hit_rate=(s["prefix_cache_hit_tokens"] / queried) if queried else 0.0,
            prompt_tokens=self.requests.prompt_tokens,
            generated_tokens=self.output.generated_tokens,
            queue_depths={
                "plans": int(s["plan_queue_depth"]),
                "outputs": int(s["output_queue_depth"]),
                "commands": int(s["command_queue_depth"]),
                "requests": self.num_unfinished(),
            },
            scheduler=s,
            pipeline_bubble_s=self.executor.bubble_seconds,
            pipeline_bubbles=self.executor.bubbles,
        )

    # ---- shutdown ----

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops all three threads and joins them (within ``timeout`` seconds); requests
        still running fail with ``EngineDeadError``."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        self.executor.stopping.set()
        self.output.stopping.set()
        try:
            self.sched.shutdown(timeout=max(0.1, timeout / 2))
        finally:
            for t in (self._exec_thread, self._output_thread):
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in (self._exec_thread, self._output_thread) if t.is_alive()]
        if self.kv_publisher is not None:  # even with the output thread stuck: its publish is then a no-op
            self.kv_publisher.close(timeout=max(0.5, deadline - time.monotonic()))
        close_runner = getattr(self.runner, "close", None)  # tensor-parallel workers: stopped and reaped
        if close_runner is not None:
            close_runner(timeout=max(1.0, deadline - time.monotonic()))
        if stuck:
            raise EngineDeadError(f"threads did not stop within {timeout}s: {', '.join(stuck)}")

    # ---- client surface (used by AsyncEngine / EngineClient) ----

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        """The tokenizer's tokenizer_config.json ({} without one): the chat template's source."""
        return dict(self._tokenizer_config)

    @property
    def steps_executed(self) -> int:
        """Executor steps finished so far; it only grows. /health's stall watchdog watches it."""
        return self.executor.step_times.count

    def thread_stacks(self) -> list[ThreadStack]:
        """The three threads with the Python stacks of the two Python ones, now."""
        frames = sys._current_frames()
        out = [ThreadStack(SCHED_THREAD_NAME, "scheduler", native=True)]
        for role, thread in self.python_threads.items():
            frame = frames.get(thread.ident) if thread.ident is not None and thread.is_alive() else None
            stack = traceback.format_stack(frame) if frame is not None else None
            out.append(ThreadStack(thread.name, role, native=False, native_id=thread.native_id, stack=stack))
        return out

    @property
    def python_threads(self) -> dict[str, threading.Thread]:
        """The engine's Python threads by role ("executor", "output"), for a stack dump;
        the scheduler thread is native (Rust) and has no Python frames."""
        return {"executor": self._exec_thread, "output": self._output_thread}
