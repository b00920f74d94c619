"""The engine-core process: one ``EngineCore`` (its three threads, unchanged) behind the link.

The main thread connects to the front end (a DEALER to its ROUTER for commands, a PUSH to
its PULL for outputs), builds the engine, says ``Ready`` (or ``LoadFailed`` with the
error), then serves commands until told to shut down. Outputs never pass through the
main thread: each request's sink puts its output into the ``Outbox``, and the output
thread flushes the outbox once per engine step, so one message carries every request's
output of that step.

The core never outlives its front end: it exits when its parent process is gone (checked
every poll, for a core the front end started) or when no front-end message (heartbeats
included) arrived for ``heartbeat_timeout`` seconds (a core on another host). On every
exit it shuts the engine down (joining its threads), and when its front end died it
removes the front end's ipc socket files, which nobody else is left to remove.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import zmq

from pyengine.config import EngineConfig
from pyengine.engine.request_state import AnyOutput
from pyengine.errors import EngineDeadError, EngineError
from pyengine.multiprocess import wire
from pyengine.outputs import EmbeddingRequestOutput
from pyengine.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.25  # how often the core reports its progress (its heartbeat)
_POLL_MS = 100
LOAD_FAILED_LINGER_MS = 2000  # how long a LoadFailed may take to leave before the core exits


class CoreLink:
    """The core's two sockets. Sends come from the main and the output thread: one lock."""

    def __init__(self, context: zmq.Context, input_address: str, output_address: str, engine_index: int) -> None:
        self.engine_index = engine_index
        self.commands = context.socket(zmq.DEALER)
        self.commands.setsockopt(zmq.IDENTITY, wire.core_identity(engine_index))
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.connect(input_address)
        self.outputs = context.socket(zmq.PUSH)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.connect(output_address)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._codec = wire.Codec(wire.ToCore)
        self._hello_codec = wire.Codec(wire.Hello)
        self._out_codec = wire.Codec(wire.ToFrontEnd)
        self._poller = zmq.Poller()
        self._poller.register(self.commands, zmq.POLLIN)

    def hello(self, message: Any) -> None:
        """``Ready`` / ``LoadFailed``, over the DEALER: the front end's ROUTER learns this
        core's identity from it before it sends the core anything."""
        self.commands.send_multipart(self._hello_codec.encode(message), copy=False)

    def send(self, message: Any) -> bool:
        """Sends to the front end; waits while its queue is full (back-pressure) but gives
        up when the core is stopping (a front end that died reads nothing). False then."""
        with self._lock:
            frames = self._out_codec.encode(message)
            while True:
                try:
                    self.outputs.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return True
                except zmq.Again:
                    if self.stopping.is_set():
                        return False
                    self.outputs.poll(_POLL_MS, zmq.POLLOUT)

    def receive(self) -> Optional[Any]:
        """The next command, or None after a poll interval without one."""
        if not self._poller.poll(_POLL_MS):
            return None
        return self._codec.decode(self.commands.recv_multipart(copy=False))

    def close(self, linger_ms: int = 0) -> None:
        """Closes both sockets; ``linger_ms`` > 0 lets what was queued (a ``LoadFailed``, sent
        before the connection may even be up) go out for that long before ``term()``."""
        self.commands.close(linger=linger_ms)
        self.outputs.close(linger=linger_ms)


class Outbox:
    """Outputs and failures of the current step, sent as one ``StepOutputs``."""

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
        with self._lock:
            outputs, failures = self._outputs, self._failures
            self._outputs, self._failures = [], []
        if outputs or failures:
            try:
                self.link.send(wire.StepOutputs(self.link.engine_index, outputs, failures))
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
    completions = [wire.WireCompletion(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                                       c.finish_reason, c.stop_reason) for c in out.outputs]
    return wire.WireOutput(out.request_id, out.finished, completions, metrics, out.num_cached_tokens)


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
    )


class CoreProcess:
    """What runs in an engine-core process's main thread (see the module docstring)."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str, engine_index: int,
                 parent_pid: Optional[int], heartbeat_timeout: float, ipc_dir: Optional[str] = None) -> None:
        self.config = config
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        self.heartbeat_timeout = heartbeat_timeout
        self.ipc_dir = ipc_dir
        self.context = zmq.Context()
        self.link = CoreLink(self.context, input_address, output_address, engine_index)
        self.outbox = Outbox(self.link)
        self.engine: Any = None
        self.stop_requested = threading.Event()  # a signal's way of asking for ``Shutdown``

    def run(self) -> int:
        """Loads, serves, shuts down: the process's exit status (1 when loading failed)."""
        try:
            from pyengine.engine.core import EngineCore

            self.engine = EngineCore(self.config, after_event=self.outbox.flush)
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
        self.link.hello(wire.Ready(self.engine_index, core_info(self.engine, os.getpid())))
        front_end_gone = False
        try:
            front_end_gone = self._serve()
        finally:
            self.link.stopping.set()  # a send blocked on a front end that reads nothing gives up
            try:
                self.engine.shutdown(timeout=3.0)
            except EngineDeadError:
                logger.exception("engine core %d: threads did not stop", self.engine_index)
            if not front_end_gone:
                self.link.send(self._status())  # the last word: in-flight failures went before it
            # A live front end reads what is queued (the failures, the last Status) at once.
            self.link.close(linger_ms=0 if front_end_gone else LOAD_FAILED_LINGER_MS)
            self.context.term()
            if front_end_gone:
                remove_ipc_dir(self.ipc_dir)
        return 0

    def _serve(self) -> bool:
        """Handles commands until ``Shutdown`` (False) or the front end is gone (True)."""
        last_heard = time.monotonic()
        next_status = 0.0
        while True:
            now = time.monotonic()
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.error("engine core %d: the front end (pid %d) is gone; exiting", self.engine_index,
                             self.parent_pid)
                return True
            if now - last_heard > self.heartbeat_timeout:
                logger.error("engine core %d: no word from the front end for %.1fs; exiting", self.engine_index,
                             now - last_heard)
                return True
            if self.stop_requested.is_set():
                return False
            if now >= next_status:
                self.link.send(self._status())
                next_status = now + STATUS_INTERVAL_S
            message = self.link.receive()
            if message is None:
                continue
            last_heard = time.monotonic()
            if isinstance(message, wire.Shutdown):
                return False
            self._handle(message)

    def _handle(self, message: Any) -> None:
        if isinstance(message, wire.AddRequest):
            self._add(message)
        elif isinstance(message, wire.Abort):
            for request_id in message.request_ids:
                self.engine.abort(request_id)
        elif isinstance(message, wire.Query):
            self.link.send(self._answer(message))

    def _add(self, message: wire.AddRequest) -> None:
        try:
            cls = PoolingParams if message.pooling else SamplingParams
            params = wire.params_from_builtins(cls, message.params)
            ids = message.prompt_token_ids.tolist()
            self.engine.add_request(message.request_id, None, ids, params, WireSink(self.outbox, message.request_id),
                                    kind=message.kind, priority=message.priority)
        except (EngineError, TypeError, ValueError) as error:
            self.outbox.fail(message.request_id, error)
            self.outbox.flush()

    def _answer(self, query: wire.Query) -> wire.Reply:
        reply = wire.Reply(self.engine_index, query.query_id)
        try:
            if query.what == "stats":
                reply.stats = self.engine.stats()
            elif query.what == "stacks":
                reply.stacks = self.engine.thread_stacks()
            else:
                reply.error = f"unknown query {query.what!r}"
        except EngineError as error:
            reply.error = str(error)
        return reply

    def _status(self) -> wire.Status:
        engine = self.engine
        reason = engine.dead_reason() or (None if engine.is_alive else "the engine was shut down")
        return wire.Status(self.engine_index, engine.steps_executed, engine.num_unfinished(), reason)


def remove_ipc_dir(ipc_dir: Optional[str]) -> None:
    """Removes the front end's private socket folder and the socket files in it."""
    if not ipc_dir:
        return
    folder = Path(ipc_dir)
    for path in folder.glob("*.sock"):
        path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty (not ours to empty further) or already gone
