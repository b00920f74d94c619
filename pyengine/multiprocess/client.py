"""``MultiprocessEngine``: the ``EngineClient`` whose engine cores run in processes of their own.

The front end (this object, in the server's process) tokenizes, sends each request to the
core with the fewest requests outstanding, and streams back what the cores send: one
``EngineCoreOutputs`` per engine step, read by one receiver thread and handed to each caller's
event loop with one ``call_soon_threadsafe`` per loop and message. Figures (stats, thread
stacks) are asked for over the link; health comes from each core's ``Status`` heartbeat
and, for a core started here, from its process: a core that dies fails its requests in
flight with ``EngineDeadError`` at once, and from then on the front end is dead
(``health()``, new requests refused) until it is shut down.

This object keeps the requests in flight and the threads (receiver, heartbeat, one
watcher per local core process); the rest is in its own module: the sockets
(``transport.py``), starting, waiting for and stopping the cores (``cores.py``,
``processes.py``), turning a caller's prompt and parameters into a checked request
(``request_prep.py``) and the stats and stack queries (``queries.py``).
``docs/multiprocess.md`` shows how to run cores on other hosts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any, Optional, Union

import numpy as np
import zmq

from pyengine.config import EngineConfig
from pyengine.entrypoints.engine_client import EngineClient, until_finished
from pyengine.errors import DuplicateRequestError, EngineDeadError, EngineError
from pyengine.inputs.prompts import PromptType
from pyengine.multiprocess import cores as core_set
from pyengine.multiprocess import wire
from pyengine.multiprocess.cores import POLL_MS, CoreState
from pyengine.multiprocess.link_options import LinkOptions
from pyengine.multiprocess.queries import QUERY_TIMEOUT_S, CoreQueries
from pyengine.multiprocess.request_prep import RequestPreparer
from pyengine.multiprocess.stats_merge import merge_stats
from pyengine.multiprocess.streams import RequestStream, deliver
from pyengine.multiprocess.transport import FrontEndLink, UnreadableMessage
from pyengine.outputs import (
    AnyOutput,
    EmbeddingRequestOutput,
    EngineHealth,
    EngineStats,
    OutputKind,
    RequestOutput,
    ThreadStack,
)
from pyengine.sampling_params import PoolingParams, SamplingParams

# At shutdown, once the cores have exited: the link this long without a message has
# delivered their last ones.
LAST_MESSAGES_QUIET_MS = 10

logger = logging.getLogger(__name__)

SILENCE_CHECK_S = 0.25  # how often a remote core's silence is checked
#: How long an abort that met a full core queue is retried (every ``SILENCE_CHECK_S``).
ABORT_RETRY_S = 60.0


class MultiprocessEngine(EngineClient):
    """``data_parallel_size`` engine cores in their own processes (see the module docstring),
    reached as ``link`` says (``LinkOptions``: transport, ports, local cores and their
    CPUs, timeouts). ``make_engine_client(config, multiprocess=True, link=...)`` builds one.

    ``abandon``: set it (a signal handler, another thread) to end a start-up that is still
    waiting for its cores: the constructor kills and reaps them and raises ``EngineError``.
    A start-up that fails at any step leaves no process, socket or ipc file behind."""

    def __init__(self, config: EngineConfig, link: Optional[LinkOptions] = None, *,
                 abandon: Optional[threading.Event] = None) -> None:
        options = link or LinkOptions()
        shares = core_set.check_local_cores(config, options.transport, options.local_cores, options.core_cpus)
        self.config = config
        self.heartbeat_timeout = heartbeat_timeout = options.heartbeat_timeout
        self._auto_ids = itertools.count()
        self._lock = threading.Lock()  # streams, queries, core states
        self._streams: dict[str, RequestStream] = {}
        # Aborts that met a full core queue, retried by the heartbeat thread: request id ->
        # (its stream, give up at). Under _lock.
        self._pending_aborts: dict[str, tuple[RequestStream, float]] = {}
        self._cores = [CoreState(i) for i in range(config.data_parallel_size)]
        self._closed = False
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        # Closes what it opened if it fails.
        self.link = FrontEndLink(options.transport, options.host, options.input_port, options.output_port)
        self._send = self.link.send
        self._queries = CoreQueries(self._cores, self._send, self._check_alive)
        try:
            core_set.start_local_cores(self._cores, config, self.link, shares, heartbeat_timeout)
            core_set.wait_ready(self._cores, self.link, options.start_timeout, abandon)
            info = self._cores[0].info
            assert info is not None
            self.info = info
            self._requests = RequestPreparer(info)
            self._start_threads()
        except BaseException:
            self._abandon()
            raise

    # ---- the threads ----

    def _start_threads(self) -> None:
        targets = [("pyengine-mp-recv", self._receive_forever), ("pyengine-mp-beat", self._heartbeat_forever)]
        targets += [(f"pyengine-mp-wait{c.index}", lambda c=c: self._watch_process(c))
                    for c in self._cores if c.process is not None]
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _receive_forever(self) -> None:
        while not self._stopping.is_set():
            self._receive_one(POLL_MS)

    def _receive_one(self, timeout_ms: int) -> bool:
        """Read and handle one message from the cores; False when none came within
        ``timeout_ms``."""
        try:
            message = self.link.receive(timeout_ms)
        except UnreadableMessage as error:
            # Which core sent it is unknown (the PULL socket says nothing): a peer that
            # breaks the protocol may have lost anything, so every core counts as failed
            # rather than leaving streams waiting for outputs that will not come.
            reason = f"an engine core sent a message this front end cannot read ({error})"
            logger.error("%s", reason)
            for core in self._cores:
                self._core_died(core, reason)
            return True
        if message is None:
            return False
        try:
            self._dispatch(message)
        except Exception as error:  # noqa: BLE001 - the receiver must outlive any one message
            index = getattr(message, "engine_index", None)
            logger.exception("handling a message from engine core %s failed", index)
            for core in [c for c in self._cores if c.index == index] or self._cores:
                self._core_died(core, f"engine core {index} broke the link's protocol: {error!r}")
        return True

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, wire.EngineCoreOutputs):
            self._step_outputs(message)
        elif isinstance(message, wire.Status):
            with self._lock:
                core = self._cores[message.engine_index]
                core.steps, core.num_unfinished = message.steps, message.num_unfinished
                core.reported_dead, core.last_status = message.dead_reason, time.monotonic()
        elif isinstance(message, wire.Reply):
            self._queries.file(message)

    def _step_outputs(self, message: wire.EngineCoreOutputs) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Union[AnyOutput, BaseException]]]] = {}
        unreadable: list[RequestStream] = []
        with self._lock:
            self._cores[message.engine_index].last_status = time.monotonic()  # a sign of life as good as a Status
            for w in message.outputs:
                stream = self._streams.get(w.request_id)
                if stream is None:
                    continue  # a request this front end already gave up on
                try:
                    item: Union[AnyOutput, BaseException] = stream.output(w)
                except Exception as error:  # noqa: BLE001 - that request fails, the others go on
                    logger.exception("request %r: an output from engine core %d could not be read",
                                     w.request_id, message.engine_index)
                    item = EngineError(f"an output of this request could not be read: {error!r}")
                    unreadable.append(stream)
                if w.finished or isinstance(item, BaseException):
                    self._forget(stream)
                by_loop.setdefault(stream.loop, []).append((stream, item))
            for f in message.failures:
                stream = self._streams.get(f.request_id)
                if stream is not None:
                    self._forget(stream)
                    by_loop.setdefault(stream.loop, []).append((stream, wire.error_from_wire(f.error_type,
                                                                                             f.message)))
        _hand_over(by_loop)
        for stream in unreadable:  # the core would go on computing it for nobody
            self._send_abort(stream)

    def _forget(self, stream: RequestStream) -> None:
        """Unregisters a request (call with ``_lock`` held)."""
        if self._streams.pop(stream.request_id, None) is stream:
            self._cores[stream.engine_index].outstanding -= 1

    def _heartbeat_forever(self) -> None:
        """A ``Heartbeat`` to every core each second; a remote core's silence checked every
        ``SILENCE_CHECK_S``, so that it is declared dead at most that long after
        ``heartbeat_timeout``."""
        next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
        while not self._stopping.wait(SILENCE_CHECK_S):
            beat = time.monotonic() >= next_beat
            if beat:
                next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
            self._retry_aborts()
            for core in self._cores:
                if core.dead is not None:
                    continue
                try:
                    if beat:
                        self._send(core.index, wire.Heartbeat())
                except zmq.ZMQError as error:
                    # A remote core reconnecting (or a full queue) is not dead: its silence,
                    # below, decides; a local one's process is watched.
                    logger.debug("heartbeat to engine core %d not sent: %s", core.index, error)
                if core.process is None and time.monotonic() - core.last_status > self.heartbeat_timeout:
                    self._core_died(core, f"engine core {core.index} sent no status for "
                                          f"{self.heartbeat_timeout:.0f}s")

    def _retry_aborts(self) -> None:
        """Sends again each abort that met a full queue; drops one whose core is dead, whose
        id a new request has taken meanwhile, or that waited ``ABORT_RETRY_S`` (logged)."""
        with self._lock:
            if not self._pending_aborts:
                return
            pending = list(self._pending_aborts.items())
        now = time.monotonic()
        for request_id, (stream, give_up_at) in pending:
            current = self._streams.get(request_id)
            drop = self._cores[stream.engine_index].dead is not None or current not in (None, stream)
            if not drop and now > give_up_at:
                logger.warning("engine core %d: the abort of request %r found its queue full for %.0fs; given up "
                               "(the request runs on to its end)", stream.engine_index, request_id, ABORT_RETRY_S)
                drop = True
            if not drop:
                try:
                    self._send(stream.engine_index, wire.Abort([request_id]))
                except zmq.Again:
                    continue  # still full: the next round
                except zmq.ZMQError:
                    pass  # unreachable: the core is gone, its requests were failed already
            with self._lock:
                if self._pending_aborts.get(request_id, (None,))[0] is stream:
                    del self._pending_aborts[request_id]

    def _watch_process(self, core: CoreState) -> None:
        assert core.process is not None
        core.process.wait()
        if not self._closed:
            self._core_died(core, core.process.describe_exit())

    def _core_died(self, core: CoreState, reason: str) -> None:
        """Fails the core's requests in flight and its pending queries; the front end is
        dead from now on."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Union[AnyOutput, BaseException]]]] = {}
        with self._lock:
            if core.dead is not None:
                return
            core.dead = reason
            for stream in [s for s in self._streams.values() if s.engine_index == core.index]:
                self._forget(stream)
                by_loop.setdefault(stream.loop, []).append((stream, EngineDeadError(reason)))
        logger.error("%s: %d request(s) in flight failed", reason, sum(len(v) for v in by_loop.values()))
        _hand_over(by_loop)
        self._queries.wake_all()  # an asker sees the core dead

    # ---- requests ----

    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, *, output_kind: OutputKind = "cumulative",
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        async with aclosing(self._stream(prompt, sampling_params or SamplingParams(), request_id, output_kind,
                                         priority)) as outputs:
            async for out in outputs:
                yield out  # type: ignore[misc]

    async def embed(self, prompt: PromptType, pooling_params: Optional[PoolingParams] = None,
                    request_id: Optional[str] = None) -> EmbeddingRequestOutput:
        result = None
        async with aclosing(self._stream(prompt, pooling_params or PoolingParams(), request_id, "final", 0)) as outs:
            async for out in outs:
                result = out
        if not isinstance(result, EmbeddingRequestOutput):
            raise EngineError("the engine core returned no embedding for this request")
        return result

    async def _stream(self, prompt: PromptType, params: Union[SamplingParams, PoolingParams],
                      request_id: Optional[str], kind: OutputKind, priority: int) -> AsyncIterator[AnyOutput]:
        self._check_alive()
        rid = request_id if request_id is not None else f"mp-{next(self._auto_ids)}"
        request = await self._requests.prepare(prompt, params, kind, self.tokenize)
        ids = request.prompt_token_ids
        stream = RequestStream(rid, 0, kind, request.prompt, ids, request.pooling, request.text, request.piece)
        with self._lock:
            self._check_alive()
            if rid in self._streams:
                raise DuplicateRequestError(f"request id {rid!r} is still in use")
            core = min(self._cores, key=lambda c: c.outstanding)  # the least loaded; the lowest index on ties
            stream.engine_index = core.index
            core.outstanding += 1
            self._streams[rid] = stream
        message = wire.AddRequest(rid, np.asarray(ids, dtype=np.int64), request.params, request.pooling,
                                  stream.wire_kind, priority, text_in_front_end=stream.text is not None)
        try:
            self._send(core.index, message)
        except BaseException as error:
            with self._lock:
                self._forget(stream)
            if isinstance(error, zmq.Again):
                raise EngineError(f"engine core {core.index} takes no more requests for now (its queue is "
                                  "full): try again") from None
            if isinstance(error, zmq.ZMQError):
                raise EngineDeadError(f"engine core {core.index} is unreachable: {error}") from None
            raise
        async with aclosing(until_finished(stream.queue, lambda: self._abort_now(rid))) as outputs:
            async for item in outputs:
                yield item

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None or self._closed:
            return
        self._send_abort(stream)

    def _send_abort(self, stream: RequestStream) -> None:
        """Never blocks (the event loop calls it): an abort that meets a full core queue is
        kept for the heartbeat thread to send again (``_retry_aborts``), not dropped, or the
        core would generate up to ``max_tokens`` for nobody."""
        try:
            self._send(stream.engine_index, wire.Abort([stream.request_id]))
        except zmq.Again:
            with self._lock:
                self._pending_aborts[stream.request_id] = (stream, time.monotonic() + ABORT_RETRY_S)
        except zmq.ZMQError:
            pass  # unreachable: the core is gone, its requests were failed already

    # ---- the model and its text ----

    @property
    def model_path(self) -> str:
        return self.info.model_path

    @property
    def tokenizer_path(self) -> str:
        return self.info.tokenizer_path or self.info.model_path

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return dict(self.info.generation_defaults)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def max_request_tokens(self) -> int:
        return self.info.max_request_tokens

    @property
    def vocab_size(self) -> Optional[int]:
        return self._requests.vocab_size

    @property
    def max_logprobs(self) -> int:
        return self.info.max_logprobs

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.info.eos_token_ids)

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        return dict(self.info.tokenizer_config)

    @property
    def tokenizer(self) -> Any:
        return self._requests.tokenizer

    @property
    def token_bytes(self) -> Optional[Sequence[bytes]]:
        return self._requests.token_bytes

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._requests.tokenize(text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._requests.decode(token_ids, skip_special_tokens)

    @property
    def input_address(self) -> str:
        """Where the cores send commands from (a core on another host connects its DEALER here)."""
        return self.link.input_address

    @property
    def output_address(self) -> str:
        return self.link.output_address

    @property
    def ipc_dir(self) -> Optional[str]:
        return self.link.ipc_dir

    @property
    def core_pids(self) -> list[Optional[int]]:
        """Each core's process id (None for a core on another host)."""
        return [c.process.pid if c.process is not None else None for c in self._cores]

    # ---- health, figures, lifetime ----

    def _dead_reason(self) -> Optional[str]:
        if self._closed:
            return "the engine was shut down"
        reasons = [c.dead or c.reported_dead for c in self._cores if (c.dead or c.reported_dead)]
        return "; ".join(reasons) if reasons else None

    def _check_alive(self) -> None:
        reason = self._dead_reason()
        if reason is not None:
            raise EngineDeadError(reason)

    def health(self) -> EngineHealth:
        """Dead when any core is (its requests failed; the others' go on, but nothing new is
        taken); steps and pending requests summed over the cores."""
        with self._lock:
            return EngineHealth(self._dead_reason(), sum(c.steps for c in self._cores),
                                sum(c.num_unfinished for c in self._cores))

    def engine_health(self) -> list[EngineHealth]:
        with self._lock:
            return [EngineHealth(c.dead or c.reported_dead, c.steps, c.num_unfinished) for c in self._cores]

    def engine_stats(self) -> dict[int, EngineStats]:
        if self._closed:
            return {}
        with self._lock:
            asked = [c for c in self._cores if c.dead is None]
        replies = self._queries.ask_live("stats", asked)
        return {i: r.stats for i, r in sorted(replies.items()) if r.stats is not None}

    def stats(self) -> EngineStats:
        """Every core's figures added up; ``EngineDeadError`` once one is dead (as
        ``health``), ``EngineError`` when one does not answer."""
        self._check_alive()
        parts = self.engine_stats()
        self._check_alive()
        missing = [c.index for c in self._cores if c.index not in parts]
        if missing:
            raise EngineError(f"engine core(s) {missing} did not answer 'stats' within {QUERY_TIMEOUT_S:.0f}s")
        return merge_stats([parts[i] for i in sorted(parts)])

    def thread_stacks(self) -> list[ThreadStack]:
        return [stack for r in self._queries.ask("stacks") for stack in (r.stacks or [])]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tells every core to stop, waits for them (killing one that does not exit within
        ``timeout``) and reaps them; requests still running fail with ``EngineDeadError``;
        the threads are joined and the ipc files removed."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        for core in self._cores:
            if core.dead is None:
                try:
                    self._send(core.index, wire.Shutdown(timeout=max(0.1, timeout - 2.0)))
                except zmq.ZMQError:
                    pass  # already gone
        core_set.stop_local_cores(self._cores, deadline)
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        if not any(t.name == "pyengine-mp-recv" and t.is_alive() for t in self._threads):
            # The cores have exited: what they sent last (the failures of what ran) is in
            # the socket or on its way through zmq's I/O thread; read it until the link is
            # quiet for a moment instead of sleeping a whole poll interval for the receiver.
            while self._receive_one(LAST_MESSAGES_QUIET_MS):
                pass
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Union[AnyOutput, BaseException]]]] = {}
        with self._lock:
            for stream in list(self._streams.values()):
                self._forget(stream)
                by_loop.setdefault(stream.loop, []).append((stream, EngineDeadError("the engine was shut down")))
        _hand_over(by_loop)
        self.link.close()

    def _abandon(self) -> None:
        """Start-up failed: kill and reap what was started, close and remove everything."""
        self._closed = True
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        core_set.kill_local_cores(self._cores)
        self.link.close()

    def __enter__(self) -> MultiprocessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> MultiprocessEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()


def _hand_over(by_loop: dict[asyncio.AbstractEventLoop, list[Any]]) -> None:
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(deliver, items)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more

