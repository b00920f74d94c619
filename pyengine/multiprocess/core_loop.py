"""The engine-core process: one ``EngineCore`` (its three threads, unchanged) behind the link.

The main thread connects to the front end (a DEALER to its ROUTER for commands, a PUSH to
its PULL for outputs), builds the engine, says ``Ready`` (or ``LoadFailed`` with the
error), then serves commands until told to shut down. Outputs never pass through the
main thread: each request's sink puts its output into the ``Outbox``, and the output
thread flushes the outbox once per engine step, so one message carries every request's
output of that step.

The core never outlives its front end: a watch thread (``watchdog.py``), started before
the model loads and independent of every send, ends it when its parent process is gone (a
core the front end started) or when no front-end message (heartbeats included) arrived
for ``heartbeat_timeout`` seconds while it waited for commands (a core on another host).
No send waits forever: a ``Status`` is dropped when the front end's queue is full, and an
output that cannot leave within ``send_timeout`` (``SEND_TIMEOUT_S``, or twice the
heartbeat timeout if longer: a front end slowed by a GC pause is not gone) stops the core.
On every exit it shuts the engine down (joining its threads), and when its front end's
process is gone it removes the front end's ipc socket files, which nobody else is left to
remove (never those of a front end that is alive but slow: it still needs them). A core with a parent
ignores SIGTERM (a supervisor signalling the whole process group must not end requests
its front end is draining): it stops on ``Shutdown`` or when its parent is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import zmq

from pyengine.config import EngineConfig
from pyengine.errors import EngineDeadError, EngineError
from pyengine.inputs.request_checks import BuiltRequest
from pyengine.multiprocess import wire
from pyengine.multiprocess.watchdog import FrontEndWatch, remove_ipc_dir
from pyengine.multiprocess.wire_logprobs import logprobs_to_wire
from pyengine.outputs import AnyOutput, EmbeddingRequestOutput
from pyengine.processes.startup_heap import freeze_startup_heap
from pyengine.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.25  # how often the core reports its progress (its heartbeat)
_POLL_MS = 100
SHUTDOWN_TIMEOUT_S = 3.0  # how long the engine's threads get to stop, unless ``Shutdown`` says
GONE_SHUTDOWN_TIMEOUT_S = 1.0  # the same once the front end is gone: nobody waits for its results
LOAD_FAILED_LINGER_MS = 2000  # how long a LoadFailed may take to leave before the core exits
#: The least time an output may wait for a front end whose queue is full before the core stops.
SEND_TIMEOUT_S = 30.0


class CoreLink:
    """The core's two sockets. Sends come from the main and the output thread: one lock,
    which ``Outbox.flush`` holds around taking a step's outputs and sending them (so the
    steps leave in order)."""

    def __init__(self, context: zmq.Context, input_address: str, output_address: str, engine_index: int,
                 send_timeout: float = 10.0) -> None:
        self.engine_index = engine_index
        self.send_timeout = send_timeout
        self.commands = context.socket(zmq.DEALER)
        self.commands.setsockopt(zmq.IDENTITY, wire.core_identity(engine_index))
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.connect(input_address)
        self.outputs = context.socket(zmq.PUSH)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.connect(output_address)
        self.stopping = threading.Event()  # set when the front end is gone or reads nothing
        self.lock = threading.RLock()
        self._codec = wire.Codec(wire.ToCore)
        self._hello_codec = wire.Codec(wire.Hello)
        self._out_codec = wire.Codec(wire.ToFrontEnd)
        self._poller = zmq.Poller()
        self._poller.register(self.commands, zmq.POLLIN)

    def hello(self, message: Any) -> None:
        """``Ready`` / ``LoadFailed``, over the DEALER: the front end's ROUTER learns this
        core's identity from it before it sends the core anything."""
        self.commands.send_multipart(self._hello_codec.encode(message), copy=False)

    def send(self, message: Any, timeout: Optional[float] = None) -> bool:
        """Sends to the front end; waits while its queue is full (back-pressure), up to
        ``timeout`` (default ``send_timeout``; 0: one try, for a ``Status`` that the next
        one replaces). False when it gave up; when a wait ran out (the front end read
        nothing for that long), ``stopping`` is set too: the core then stops."""
        timeout = self.send_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        acquired = self.lock.acquire(timeout=timeout) if timeout > 0 else self.lock.acquire(blocking=False)
        if not acquired:
            return False
        try:
            frames = self._out_codec.encode(message)
            while True:
                try:
                    self.outputs.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return True
                except zmq.Again:
                    left = deadline - time.monotonic()
                    if self.stopping.is_set() or timeout == 0:
                        return False
                    if left <= 0:
                        logger.error("engine core %d: the front end read nothing for %.0fs; stopping",
                                     self.engine_index, timeout)
                        self.stopping.set()
                        return False
                    self.outputs.poll(min(_POLL_MS, max(1, int(left * 1000))), zmq.POLLOUT)
        finally:
            self.lock.release()

    def receive(self) -> Optional[Any]:
        """The next command, or None after a poll interval without one. A message that does
        not decode (a peer of another version, stray bytes) is logged and dropped: None."""
        if not self._poller.poll(_POLL_MS):
            return None
        frames = self.commands.recv_multipart(copy=False)
        try:
            return self._codec.decode(frames)
        except Exception as error:  # noqa: BLE001 - one bad message must not end the core
            logger.error("engine core %d: dropped a message that does not decode (%s: %s)", self.engine_index,
                         type(error).__name__, error)
            return None

    def close(self, linger_ms: int = 0) -> None:
        """Closes both sockets; ``linger_ms`` > 0 lets what was queued (a ``LoadFailed``, sent
        before the connection may even be up) go out for that long before ``term()``."""
        self.commands.close(linger=linger_ms)
        self.outputs.close(linger=linger_ms)


class Outbox:
    """Outputs and failures of the current step, sent as one ``EngineCoreOutputs``."""

    def __init__(self, link: CoreLink) -> None:
        self.link = link
        self._lock = threading.Lock()
        self._outputs: list[wire.WireOutput] = []
        self._failures: list[wire.WireFailure] = []

    def put(self, output: AnyOutput) -> None:
        item = output_to_wire(output)
        with self._lock:
            self._outputs.append(item)

    def fail(self, request_id: str, error: BaseException) -> None:
        item = wire.WireFailure(request_id, *wire.error_to_wire(error))
        with self._lock:
            self._failures.append(item)

    def flush(self) -> None:
        """Sends what was put since the last flush. The link's lock is held from taking the
        lists to the send: the output thread's flush of step k and the main thread's (a
        refused request) cannot overtake each other."""
        with self.link.lock:
            with self._lock:
                outputs, failures = self._outputs, self._failures
                self._outputs, self._failures = [], []
            if outputs or failures:
                try:
                    self.link.send(wire.EngineCoreOutputs(self.link.engine_index, outputs, failures))
                except zmq.ZMQError:
                    logger.exception("could not send a step's outputs to the front end")


class WireSink:
    """A request's sink inside the core: its outputs go to the outbox."""

    __slots__ = ("outbox", "request_id")

    def __init__(self, outbox: Outbox, request_id: str) -> None:
        self.outbox = outbox
        self.request_id = request_id

    def put(self, output: AnyOutput) -> None:
        self.outbox.put(output)

    def fail(self, error: BaseException) -> None:
        self.outbox.fail(self.request_id, error)


def output_to_wire(out: AnyOutput) -> wire.WireOutput:
    m = out.metrics
    metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                      m.last_token_time, m.finished_time, m.num_cached_tokens, m.num_preemptions)
    if isinstance(out, EmbeddingRequestOutput):
        vector = np.asarray(out.outputs.embedding, dtype=np.float32)  # the executor pools in float32
        return wire.WireOutput(out.request_id, True, [], metrics, 0, vector)
    completions = [wire.WireCompletion(c.index, c.text, c.token_ids, c.cumulative_logprob,
                                       None if (lps := c.logprob_arrays) is None else logprobs_to_wire(lps),
                                       c.finish_reason, c.stop_reason) for c in out.outputs]
    plp = out.prompt_logprob_arrays
    prompt_logprobs = logprobs_to_wire(plp) if plp is not None else None
    return wire.WireOutput(out.request_id, out.finished, completions, metrics, out.num_cached_tokens,
                           prompt_logprobs=prompt_logprobs)


def core_info(engine: Any, pid: int) -> wire.CoreInfo:
    tokenizer = engine.tokenizer
    return wire.CoreInfo(
        model_path=str(engine.model_path),
        max_model_len=int(engine.max_model_len),
        max_request_tokens=int(engine.max_request_tokens),
        vocab_size=int(engine.vocab_size) if engine.vocab_size else None,
        max_logprobs=int(engine.config.max_logprobs),
        tokenizer_json=tokenizer.to_str() if tokenizer is not None else None,
        tokenizer_config=engine.tokenizer_config,
        pid=pid,
        eos_token_ids=[int(t) for t in engine.eos_token_ids],
        tokenizer_path=str(engine.tokenizer_path),
        generation_defaults=dict(engine.generation_defaults),
    )


class CoreMainLoop:
    """What runs in an engine-core process's main thread (see the module docstring)."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str, engine_index: int,
                 parent_pid: Optional[int], heartbeat_timeout: float, ipc_dir: Optional[str] = None,
                 watch: Optional[FrontEndWatch] = None, freeze_heap: bool = False,
                 send_timeout: Optional[float] = None) -> None:
        self.config = config
        self.freeze_heap = freeze_heap  # the process is ours: its start-up heap frozen once loaded
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        self.heartbeat_timeout = heartbeat_timeout
        self.ipc_dir = ipc_dir
        self.watch = watch or FrontEndWatch(engine_index, parent_pid, heartbeat_timeout, ipc_dir)
        self.context = zmq.Context()
        self.link = CoreLink(self.context, input_address, output_address, engine_index,
                             send_timeout=send_timeout or max(SEND_TIMEOUT_S, 2 * heartbeat_timeout))
        self.outbox = Outbox(self.link)
        self.engine_core: Any = None
        self.stop_requested = threading.Event()  # a signal's way of asking for ``Shutdown``
        self.shutdown_timeout = SHUTDOWN_TIMEOUT_S
        # A request with a constraint is compiled (and then added) here, off the main
        # thread: adds, aborts and heartbeats are not held up behind a large grammar.
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pyengine-core{engine_index}-compile")
        self._pending_lock = threading.Lock()
        self._compiling: set[str] = set()
        self._aborted: set[str] = set()  # aborted while compiling: aborted once added

    def run(self) -> int:
        """Loads, serves, shuts down: the process's exit status (1 when loading failed)."""
        self.watch.start()  # idempotent for a watch started before the config was read
        try:
            try:
                from pyengine.engine.core import EngineCore

                self.engine_core = EngineCore(self.config, after_event=self.outbox.flush,
                                              data_parallel_rank=self.engine_index)
            except BaseException as error:  # noqa: BLE001 - reported to the front end, which exits with it
                # Always on the core's stderr too: the LoadFailed can still be lost (a front end
                # that died meanwhile), and a bug's traceback is what a report needs.
                if isinstance(error, EngineError):
                    logger.error("engine core %d failed to load: %s", self.engine_index, error)
                else:
                    logger.exception("engine core %d failed to load", self.engine_index)
                self.link.hello(wire.LoadFailed(self.engine_index, *wire.error_to_wire(error)))
                self.link.close(linger_ms=LOAD_FAILED_LINGER_MS)
                self.context.term()
                return 1
            self.watch.serving(self._front_end_gone)
            if self.freeze_heap:
                freeze_startup_heap()
            self.link.hello(wire.Ready(self.engine_index, core_info(self.engine_core, os.getpid()), wire.PROTOCOL_VERSION))
            try:
                self._serve()
            finally:
                front_end_gone = self.watch.gone_reason is not None or self.link.stopping.is_set()
                self.link.stopping.set()  # a send blocked on a front end that reads nothing gives up
                try:
                    self.engine_core.shutdown(timeout=self.shutdown_timeout)
                except EngineDeadError:
                    logger.exception("engine core %d: threads did not stop", self.engine_index)
                # A compile still running ends in an add the dead engine refuses (a failure sent).
                self._compiler.shutdown(wait=True, cancel_futures=True)
                if not front_end_gone:
                    self.link.stopping.clear()
                    self.link.send(self._status(), timeout=1.0)  # the last word: in-flight failures went first
                # A live front end reads what is queued (the failures, the last Status) at once.
                self.link.close(linger_ms=0 if front_end_gone else LOAD_FAILED_LINGER_MS)
                self.context.term()
                if self.watch.parent_gone():  # not a send that timed out: that front end may live
                    remove_ipc_dir(self.ipc_dir)
            return 0
        finally:
            self.watch.close()

    def _front_end_gone(self, reason: str) -> None:
        """The watch's word (its thread): stop, and let no send wait for a reader."""
        self.shutdown_timeout = min(self.shutdown_timeout, GONE_SHUTDOWN_TIMEOUT_S)
        self.link.stopping.set()
        self.stop_requested.set()

    def _serve(self) -> None:
        """Handles commands until ``Shutdown``, a stop request, or the front end is gone."""
        next_status = 0.0
        while not (self.stop_requested.is_set() or self.link.stopping.is_set()):
            now = time.monotonic()
            if now >= next_status:
                self.link.send(self._status(), timeout=0)  # dropped when the queue is full: the next one says it
                next_status = now + STATUS_INTERVAL_S
            message = self.link.receive()
            if message is None:
                continue
            self.watch.heard()
            try:
                if isinstance(message, wire.Shutdown):
                    self.shutdown_timeout = max(0.1, float(message.timeout))
                    return
                self._handle(message)
            finally:
                self.watch.idle()

    def _handle(self, message: Any) -> None:
        if isinstance(message, wire.AddRequest):
            self._add(message)
        elif isinstance(message, wire.Abort):
            for request_id in message.request_ids:
                with self._pending_lock:
                    if request_id in self._compiling:
                        self._aborted.add(request_id)
                        continue
                self.engine_core.abort(request_id)
        elif isinstance(message, wire.Query):
            self.link.send(self._answer(message))

    def _add(self, message: wire.AddRequest) -> None:
        try:
            cls = PoolingParams if message.pooling else SamplingParams
            params = wire.params_from_builtins(cls, message.params)
            if isinstance(params, SamplingParams) and params.structured_outputs is not None:
                with self._pending_lock:
                    self._compiling.add(message.request_id)
                self._compiler.submit(self._compile_then_add, message, params)
                return
            self._add_now(message, params)
        except Exception as error:  # noqa: BLE001 - only this request fails, whatever it brought
            self._fail(message.request_id, error)

    def _compile_then_add(self, message: wire.AddRequest, params: SamplingParams) -> None:
        """The compile thread: adds the request, which compiles its constraint (once: the
        front end does not compile it, it refuses a bad one when the core's error comes)."""
        try:
            self._add_now(message, params)
        except Exception as error:  # noqa: BLE001 - only this request fails, whatever it brought
            self._fail(message.request_id, error)
        finally:
            with self._pending_lock:
                self._compiling.discard(message.request_id)
                aborted = message.request_id in self._aborted
                self._aborted.discard(message.request_id)
            if aborted:
                self.engine_core.abort(message.request_id)

    def _add_now(self, message: wire.AddRequest, params: Any) -> None:
        """Queues the request as its front end built it (``build_request``: checked,
        truncated); the engine makes only the checks it alone can."""
        request = BuiltRequest(None, message.prompt_token_ids.tolist(), params)
        self.engine_core.submit(message.request_id, request, WireSink(self.outbox, message.request_id), kind=message.kind,
                           priority=message.priority, make_text=not message.text_in_front_end)

    def _fail(self, request_id: str, error: Exception) -> None:
        if not isinstance(error, (EngineError, TypeError, ValueError)):
            logger.exception("engine core %d: request %r could not be added", self.engine_index, request_id)
        self.outbox.fail(request_id, error)
        self.outbox.flush()

    def _answer(self, query: wire.Query) -> wire.Reply:
        reply = wire.Reply(self.engine_index, query.query_id)
        try:
            if query.what == "stats":
                reply.stats = self.engine_core.stats()
            elif query.what == "stacks":
                reply.stacks = self.engine_core.thread_stacks()
            else:
                reply.error = f"unknown query {query.what!r}"
        except Exception as error:  # noqa: BLE001 - the asker gets the error; the core goes on
            reply.error = str(error) if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"
        return reply

    def _status(self) -> wire.Status:
        engine = self.engine_core
        reason = engine.dead_reason() or (None if engine.is_alive else "the engine was shut down")
        return wire.Status(self.engine_index, engine.steps_executed, engine.num_unfinished(), reason)

