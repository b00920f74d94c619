"""``MultiprocessEngine``: the ``EngineClient`` whose engine cores run in processes of their own.

The front end (this object, in the server's process) tokenizes, sends each request to the
core with the fewest requests outstanding, and streams back what the cores send: one
``StepOutputs`` per engine step, read by one receiver thread and handed to each caller's
event loop with one ``call_soon_threadsafe`` per loop and message. Figures (stats, thread
stacks) are asked for over the link; health comes from each core's ``Status`` heartbeat
and, for a core started here, from its process: a core that dies fails its requests in
flight with ``EngineDeadError`` at once, and from then on the front end is dead
(``health()``, new requests refused) until it is shut down.

Sockets: the front end binds (ipc:// files in a private temporary folder, or tcp://), the
cores connect; ``docs/multiprocess.md`` shows how to run cores on other hosts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any, Optional, Union

import numpy as np
import zmq

from pyengine.config import EngineConfig
from pyengine.engine.grammar import ConstraintCompiler
from pyengine.entrypoints.engine_client import EngineClient, normalize_off_loop, until_finished
from pyengine.errors import DuplicateRequestError, EngineDeadError, EngineError, InvalidRequestError
from pyengine.inputs.prompts import PromptType
from pyengine.inputs.request_checks import checked_params, truncated_prompt
from pyengine.multiprocess import wire
from pyengine.multiprocess.front_text import FrontEndText, makes_text_in_front_end
from pyengine.multiprocess.processes import CoreProcessHandle, cpu_shares, device_env
from pyengine.multiprocess.stats_merge import merge_stats
from pyengine.multiprocess.streams import AnyOutput, RequestStream, deliver
from pyengine.outputs import (
    EmbeddingRequestOutput,
    EngineHealth,
    EngineStats,
    OutputKind,
    RequestOutput,
    ThreadStack,
)
from pyengine.sampling_params import PoolingParams, SamplingParams
from pyengine.text import DecodeTable
from pyengine.text.encode import encode_ids

logger = logging.getLogger(__name__)

SILENCE_CHECK_S = 0.25  # how often a remote core's silence is checked
QUERY_TIMEOUT_S = 10.0
#: How long an abort that met a full core queue is retried (every ``SILENCE_CHECK_S``).
ABORT_RETRY_S = 60.0
_POLL_MS = 100


class _CoreState:
    """What the front end knows of one core."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Optional[CoreProcessHandle] = None  # None for a core on another host
        self.info: Optional[wire.CoreInfo] = None
        self.outstanding = 0
        self.steps = 0
        self.num_unfinished = 0
        self.reported_dead: Optional[str] = None  # the core's own word (a thread died)
        self.dead: Optional[str] = None  # gone: its process exited, or it fell silent
        self.last_status = time.monotonic()


class MultiprocessEngine(EngineClient):
    """``data_parallel_size`` engine cores in their own processes (see the module docstring).

    - ``transport``: "ipc" (sockets in a private temporary folder) or "tcp" (``host`` and
      ``input_port`` / ``output_port``; 0 picks free ports).
    - ``local_cores``: how many cores to start here (default all); the others are started
      on other hosts with ``pyengine core`` and connect to the tcp addresses.
    - ``core_cpus``: the CPUs the local cores split among themselves (default: no pinning
      for one core, this process's CPUs for several).
    - ``start_timeout``: seconds to wait for every core's ``Ready``.
    - ``heartbeat_timeout``: a core exits after this long without a word from here; a core
      on another host is declared dead after this long without a ``Status``.
    - ``abandon``: set it (a signal handler, another thread) to end a start-up that is still
      waiting for its cores: the constructor kills and reaps them and raises ``EngineError``.
    A start-up that fails at any step leaves no process, socket or ipc file behind."""

    def __init__(self, config: EngineConfig, *, transport: str = "ipc", host: str = "127.0.0.1",
                 input_port: int = 0, output_port: int = 0, local_cores: Optional[int] = None,
                 core_cpus: Optional[Sequence[int]] = None, start_timeout: float = 600.0,
                 heartbeat_timeout: float = wire.DEFAULT_HEARTBEAT_TIMEOUT_S,
                 abandon: Optional[threading.Event] = None) -> None:
        if transport not in ("ipc", "tcp"):
            raise EngineError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        n = config.data_parallel_size
        local = n if local_cores is None else local_cores
        if not 0 <= local <= n or (transport == "ipc" and local != n):
            raise EngineError(f"local_cores = {local_cores}: between 0 and data_parallel_size = {n}, and all of "
                              "them with transport='ipc' (cores on other hosts need tcp)")
        self.config = config
        self.heartbeat_timeout = heartbeat_timeout
        self._auto_ids = itertools.count()
        self._query_ids = itertools.count()
        self._lock = threading.Lock()  # streams, queries, core states
        self._send_lock = threading.Lock()  # the ROUTER socket
        self._streams: dict[str, RequestStream] = {}
        # Aborts that met a full core queue, retried by the heartbeat thread: request id ->
        # (its stream, give up at). Under _lock.
        self._pending_aborts: dict[str, tuple[RequestStream, float]] = {}
        self._queries: dict[int, tuple[threading.Event, list[wire.Reply]]] = {}
        self._cores = [_CoreState(i) for i in range(n)]
        self._closed = False
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._codec = wire.Codec(wire.ToCore)  # used under _send_lock
        self._hello_codec = wire.Codec(wire.Hello)
        shares = cpu_shares(local, core_cpus) if local else []
        for i in range(local):
            device_env(config, i)  # a device setting that cannot work fails here, before any process starts
        self._decode_table: Optional[DecodeTable] = None
        self._compiler: Optional[ConstraintCompiler] = None
        self._compiler_lock = threading.Lock()
        self.ipc_dir: Optional[str] = None
        try:
            self.ipc_dir = tempfile.mkdtemp(prefix="pyengine-") if transport == "ipc" else None
            self.context = zmq.Context()
            self._bind(transport, host, input_port, output_port)
            for i in range(local):
                self._cores[i].process = CoreProcessHandle(config, i, self._local_address(self.input_address),
                                                     self._local_address(self.output_address), shares[i],
                                                     heartbeat_timeout, self.ipc_dir)
            self._wait_ready(start_timeout, abandon)
            info = self._cores[0].info
            assert info is not None
            self.info = info
            self._tokenizer = _tokenizer(info.tokenizer_json)
            # Built once (a pass over the vocabulary): streamed text is made here (front_text.py),
            # the token table and a constraint compiler come from it.
            self._decode_table = DecodeTable.from_tokenizer(self._tokenizer) if self._tokenizer is not None else None
            self._start_threads()
        except BaseException:
            self._abandon()
            raise

    # ---- start-up and the sockets ----

    def _bind(self, transport: str, host: str, input_port: int, output_port: int) -> None:
        self._commands = self.context.socket(zmq.ROUTER)
        self._commands.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a core that is gone raises
        self._commands.setsockopt(zmq.LINGER, 0)
        self._outputs = self.context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        if transport == "ipc":
            self._commands.bind(f"ipc://{self.ipc_dir}/input.sock")
            self._outputs.bind(f"ipc://{self.ipc_dir}/output.sock")
        else:
            self._commands.bind(f"tcp://{host}:{input_port or '*'}")
            self._outputs.bind(f"tcp://{host}:{output_port or '*'}")
        self.input_address = self._commands.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.output_address = self._outputs.getsockopt(zmq.LAST_ENDPOINT).decode()

    @staticmethod
    def _local_address(address: str) -> str:
        """Where a core on this host connects: a wildcard bind is reached on loopback."""
        return address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")

    def _wait_ready(self, timeout: float, abandon: Optional[threading.Event]) -> None:
        """Every core's ``Ready``; a ``LoadFailed`` (or a core that exits first) raises its
        error, and so does a hello this front end cannot read or whose protocol version is
        not its own, or ``abandon`` set. Cores already ready get heartbeats meanwhile
        (another may load long)."""
        deadline = time.monotonic() + timeout
        waiting = {c.index for c in self._cores}
        exited_at: dict[int, float] = {}
        next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
        while waiting:
            if abandon is not None and abandon.is_set():
                raise EngineError(f"start-up abandoned while engine core(s) {sorted(waiting)} were not ready")
            if self._commands.poll(_POLL_MS):
                hello = self._read_hello(self._commands.recv_multipart(copy=False))
                if hello.engine_index not in waiting:
                    raise EngineError(f"engine core {hello.engine_index} said ready twice, or is not one of the "
                                      f"{len(self._cores)} cores (check --engine-index)")
                core = self._cores[hello.engine_index]
                core.info, core.last_status = hello.info, time.monotonic()  # its load is not silence
                waiting.discard(hello.engine_index)
                continue
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + wire.HEARTBEAT_INTERVAL_S
                for core in self._cores:
                    if core.index not in waiting:
                        self._send(core.index, wire.Heartbeat())
            for core in self._cores:
                if core.process is not None and core.index in waiting and core.process.exit_status() is not None:
                    # Its LoadFailed, sent before it exited, may still be on its way.
                    if now - exited_at.setdefault(core.index, now) > 1.0:
                        raise EngineError(f"{core.process.describe_exit()} before it was ready (see its log above)")
            if now > deadline:
                raise EngineError(f"engine core(s) {sorted(waiting)} not ready within {timeout:.0f}s")

    def _read_hello(self, frames: list[Any]) -> wire.Ready:
        """A core's ``Ready``; its ``LoadFailed`` raised as its error; anything else (another
        version's hello, stray bytes) an ``EngineError`` that says so."""
        try:
            hello = self._hello_codec.decode(frames[1:])
        except Exception as error:  # noqa: BLE001 - a peer's bytes: a clear error, not a decoder's traceback
            raise EngineError(f"an engine core ({bytes(frames[0].bytes)!r}) sent a hello this front end cannot "
                              f"read (a different pyengine version?): {error}") from None
        if isinstance(hello, wire.LoadFailed):
            raise wire.error_from_wire(hello.error_type, f"engine core {hello.engine_index} failed to "
                                       f"load: {hello.message}")
        if hello.protocol_version != wire.PROTOCOL_VERSION:
            raise EngineError(f"engine core {hello.engine_index} speaks link protocol {hello.protocol_version}, "
                              f"this front end {wire.PROTOCOL_VERSION}: run the same pyengine version on both")
        return hello

    def _start_threads(self) -> None:
        targets = [("pyengine-mp-recv", self._receive_forever), ("pyengine-mp-beat", self._heartbeat_forever)]
        targets += [(f"pyengine-mp-wait{c.index}", lambda c=c: self._watch_process(c))
                    for c in self._cores if c.process is not None]
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _send(self, index: int, message: Any) -> None:
        """Never blocks (the event loop calls it): ``zmq.Again`` when core ``index``'s queue
        is full, another ``zmq.ZMQError`` when the core is not connected."""
        frames = [wire.core_identity(index)]
        with self._send_lock:
            frames += self._codec.encode(message)
            self._commands.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    # ---- the threads ----

    def _receive_forever(self) -> None:
        codec = wire.Codec(wire.ToFrontEnd)
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self._outputs.recv_multipart(copy=False)
            try:
                message = codec.decode(frames)
            except Exception as error:  # noqa: BLE001 - the receiver must outlive any one message
                # Which core sent it is unknown (the PULL socket says nothing): a peer that
                # breaks the protocol may have lost anything, so every core counts as failed
                # rather than leaving streams waiting for outputs that will not come.
                reason = f"an engine core sent a message this front end cannot read ({error})"
                logger.error("%s", reason)
                for core in self._cores:
                    self._core_died(core, reason)
                continue
            try:
                self._dispatch(message)
            except Exception as error:  # noqa: BLE001 - the receiver must outlive any one message
                index = getattr(message, "engine_index", None)
                logger.exception("handling a message from engine core %s failed", index)
                for core in [c for c in self._cores if c.index == index] or self._cores:
                    self._core_died(core, f"engine core {index} broke the link's protocol: {error!r}")

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, wire.StepOutputs):
            self._step_outputs(message)
        elif isinstance(message, wire.Status):
            with self._lock:
                core = self._cores[message.engine_index]
                core.steps, core.num_unfinished = message.steps, message.num_unfinished
                core.reported_dead, core.last_status = message.dead_reason, time.monotonic()
        elif isinstance(message, wire.Reply):
            with self._lock:
                waiter = self._queries.get(message.query_id)
            if waiter is not None:
                waiter[1].append(message)
                waiter[0].set()

    def _step_outputs(self, message: wire.StepOutputs) -> None:
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

    def _watch_process(self, core: _CoreState) -> None:
        assert core.process is not None
        core.process.wait()
        if not self._closed:
            self._core_died(core, core.process.describe_exit())

    def _core_died(self, core: _CoreState, reason: str) -> None:
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
            waiters = list(self._queries.values())
        logger.error("%s: %d request(s) in flight failed", reason, sum(len(v) for v in by_loop.values()))
        _hand_over(by_loop)
        for event, _ in waiters:
            event.set()  # the asker sees the core dead

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
        text, ids = await normalize_off_loop(prompt, self.tokenize)
        params = checked_params(params, ids, self.vocab_size, self.max_logprobs)
        ids = truncated_prompt(ids, params, self.max_model_len)  # the output's prompt_token_ids are the truncated ones
        if isinstance(params, SamplingParams):
            await self.prepare(params)
        pooling = isinstance(params, PoolingParams)
        if not ids:
            raise InvalidRequestError("prompt is empty: at least one token is needed")
        stream = RequestStream(rid, 0, kind, text, ids, pooling)
        if isinstance(params, SamplingParams) and makes_text_in_front_end(params, self._decode_table, stream.wire_kind):
            stream.text = FrontEndText(self._decode_table, ids, params, self.info.eos_token_ids)
        with self._lock:
            self._check_alive()
            if rid in self._streams:
                raise DuplicateRequestError(f"request id {rid!r} is still in use")
            core = min(self._cores, key=lambda c: c.outstanding)  # the least loaded; the lowest index on ties
            stream.engine_index = core.index
            core.outstanding += 1
            self._streams[rid] = stream
        message = wire.AddRequest(rid, np.asarray(ids, dtype=np.int64), params, pooling, stream.wire_kind, priority,
                                  text_in_front_end=stream.text is not None)
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
        if self.info.vocab_size:
            return self.info.vocab_size
        return self._tokenizer.get_vocab_size() if self._tokenizer is not None else None

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
        return self._tokenizer

    @property
    def token_bytes(self) -> Optional[Sequence[bytes]]:
        return self._decode_table.token_bytes if self._decode_table is not None else None

    async def prepare(self, sampling_params: SamplingParams) -> None:
        """Compiles the request's constraint here too (a worker thread, the GIL released;
        at once when cached), so that a bad schema or grammar is refused before anything is
        sent, as in-process, not one round trip later in the middle of a stream. The core
        compiles it again for its scheduler."""
        constraint = sampling_params.structured_outputs
        if constraint is None:
            return
        constraint.validate()
        compiler = self._compiler
        if compiler is not None and compiler.native is not None and compiler.is_cached(constraint):
            return
        await asyncio.to_thread(self._compile, constraint)

    def _compile(self, constraint: Any) -> None:
        """Compiles ``constraint`` as the core will (``InvalidRequestError`` when it is bad)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = ConstraintCompiler.for_engine(self._decode_table, list(self.info.eos_token_ids),
                                                               self.vocab_size)
        self._compiler.compile(constraint)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json: pass token ids instead of text")
        return encode_ids(self._tokenizer, text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

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

    def _ask(self, what: str) -> list[wire.Reply]:
        """Every core's answer to ``what``; ``EngineDeadError`` when one cannot answer."""
        self._check_alive()
        query_id = next(self._query_ids)
        event, replies = threading.Event(), []
        with self._lock:
            self._queries[query_id] = (event, replies)
        try:
            for core in self._cores:
                self._send(core.index, wire.Query(query_id, what))
            deadline = time.monotonic() + QUERY_TIMEOUT_S
            while len(replies) < len(self._cores):
                event.wait(max(0.0, deadline - time.monotonic()))
                event.clear()
                self._check_alive()
                if time.monotonic() > deadline and len(replies) < len(self._cores):
                    raise EngineError(f"engine cores did not answer {what!r} within {QUERY_TIMEOUT_S:.0f}s")
        except zmq.Again:
            # A core that is not reading (stalled, or busy for longer than its queue lasts)
            # is not dead: its process and its heartbeat decide that.
            raise EngineError(f"an engine core's command queue is full, so {what!r} could not be asked: "
                              "try again") from None
        except zmq.ZMQError as error:
            raise EngineDeadError(f"an engine core is unreachable: {error}") from None
        finally:
            with self._lock:
                self._queries.pop(query_id, None)
        for reply in replies:
            if reply.error is not None:
                raise EngineDeadError(f"engine core {reply.engine_index}: {reply.error}")
        return sorted(replies, key=lambda r: r.engine_index)

    def _ask_live(self, what: str) -> dict[int, wire.Reply]:
        """The answer to ``what`` of every core that is alive, by engine index; a core that
        is dead, dies meanwhile, answers with an error or not within ``QUERY_TIMEOUT_S`` is
        left out (one dead core must not hide the others' figures)."""
        if self._closed:
            return {}
        query_id = next(self._query_ids)
        event, replies = threading.Event(), []
        with self._lock:
            self._queries[query_id] = (event, replies)
            asked = [c for c in self._cores if c.dead is None]
        try:
            sent = []
            for core in asked:
                try:
                    self._send(core.index, wire.Query(query_id, what))
                    sent.append(core)
                except zmq.ZMQError:
                    pass  # unreachable or its queue is full: left out
            deadline = time.monotonic() + QUERY_TIMEOUT_S
            while time.monotonic() < deadline:
                answered = {r.engine_index for r in list(replies)}
                if all(c.index in answered or c.dead is not None for c in sent):
                    break
                event.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                event.clear()
        finally:
            with self._lock:
                self._queries.pop(query_id, None)
        return {r.engine_index: r for r in list(replies) if r.error is None}

    def engine_stats(self) -> dict[int, EngineStats]:
        return {i: r.stats for i, r in sorted(self._ask_live("stats").items()) if r.stats is not None}

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
        return [stack for r in self._ask("stacks") for stack in (r.stacks or [])]

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
        for core in self._cores:
            if core.process is not None:
                core.process.stop(deadline - time.monotonic())
        time.sleep(_POLL_MS / 1000)  # the cores' last messages (failures of what ran) are read
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Union[AnyOutput, BaseException]]]] = {}
        with self._lock:
            for stream in list(self._streams.values()):
                self._forget(stream)
                by_loop.setdefault(stream.loop, []).append((stream, EngineDeadError("the engine was shut down")))
        _hand_over(by_loop)
        self._close_sockets()

    def _abandon(self) -> None:
        """Start-up failed: kill and reap what was started, close and remove everything."""
        self._closed = True
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        for core in self._cores:
            if core.process is not None:
                core.process.popen.kill()
                core.process.popen.wait(10.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("_commands", "_outputs"):
            socket = getattr(self, name, None)
            if socket is not None:
                socket.close(linger=0)
        context = getattr(self, "context", None)  # None: the start-up failed before it was made
        if context is not None:
            context.term()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

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


def _tokenizer(tokenizer_json: Optional[str]) -> Any:
    if tokenizer_json is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)
