"""The KV-event publisher: a thread of its own (``pyengine-kvpub``) that owns a ZMQ PUB
socket and, optionally, a ROUTER socket serving replays, fed by a bounded queue.

The output thread calls ``publish`` once per output event that carries a log: it stamps
the batch with the time and the next sequence number and queues it without waiting. A
full queue drops the batch and counts it (``dropped``); the sequence number is spent all
the same, so a subscriber sees the gap and knows its view is incomplete (the batch is
not in the replay buffer either). The engine never waits for a slow subscriber or a
stalled publisher thread.

Wire (vLLM's): every batch is three frames, ``(topic, seq as 8 bytes big-endian,
msgpack payload)``. The replay socket takes ``(identity, b"", start seq as 8 bytes)``
from a REQ or DEALER client and answers one ``(identity, b"", seq, payload)`` per
buffered batch from ``start`` on, then ``(identity, b"", -1 as 8 signed bytes, b"")``.

The replay socket's send high-water mark is ``buffer_steps + 1``: a ROUTER drops what
exceeds it silently, and one replay is up to the whole buffer and its end marker.

The thread blocks in ``zmq.Poller.poll`` on the replay socket and an inproc wake-up pair
(the output thread sends one empty frame per batch queued): it never polls on a timer.
A replay that fails is logged and the thread goes on serving. The thread owns its sockets
and closes them as it ends, so ``close`` never closes one under it: a thread that did not
stop within ``close``'s timeout still closes them, once, when it does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Optional

import msgspec
import zmq

from pyengine.engine.thread_names import name_current_thread
from pyengine.errors import EngineError
from pyengine.kv_events.config import KVEventsConfig, offset_endpoint
from pyengine.kv_events.wire import KVEventBatch, events_from_log

logger = logging.getLogger(__name__)

THREAD_NAME = "pyengine-kvpub"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_CLOSE_TIMEOUT_S = 5.0


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport is bound, anything else connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Publishes one engine core's KV-cache events (see the module docstring)."""

    def __init__(self, config: KVEventsConfig, block_size: int, medium: str, data_parallel_rank: int = 0,
                 context: Optional[zmq.Context] = None) -> None:
        self.block_size = block_size
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self.topic = config.topic.encode()
        self.published = 0
        self.dropped = 0
        self._next_seq = 0
        self._queue: queue.Queue[tuple[int, float, tuple]] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stopping = threading.Event()
        self._close_lock = threading.Lock()  # the wake-up sent by close vs the thread closing sockets
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._sockets: list[zmq.Socket] = []
        try:
            self._pub = self._socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            self._attach(self._pub, self.endpoint, "endpoint")
            self._replay: Optional[zmq.Socket] = None
            if self.replay_endpoint is not None:
                self._replay = self._socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
                self._attach(self._replay, self.replay_endpoint, "replay_endpoint", bind=True)
            wake = f"inproc://pyengine-kvpub-wake-{id(self)}"
            self._wake_rx = self._socket(zmq.PAIR)
            self._wake_rx.bind(wake)
            self._wake_tx = self._socket(zmq.PAIR)
            self._wake_tx.connect(wake)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        self._sockets.append(s)
        return s

    @staticmethod
    def _attach(socket: zmq.Socket, endpoint: str, key: str, bind: Optional[bool] = None) -> None:
        try:
            if binds(endpoint) if bind is None else bind:
                socket.bind(endpoint)
            else:
                socket.connect(endpoint)
        except zmq.ZMQError as e:
            raise EngineError(f"kv_events_config: {key} {endpoint!r}: {e}") from None

    # ---- the output thread's side ----

    def publish(self, log: tuple) -> None:
        """Queues one output event's log (``OutputEvent.kv_events``); never blocks."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, time.time(), log))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV-event queue full: %d batches dropped so far (seq %d lost)", self.dropped, seq)
            return
        with self._close_lock:  # an output thread that outlived shutdown never sends on a closed socket
            if not self._sockets:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # a thousand wake-ups unread: the thread is awake with work queued
                pass

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Publishes what is queued, stops the thread and (through it) closes every socket.
        Safe to call again, and while ``publish`` may still be called (an output thread
        that did not stop): such batches are dropped."""
        with self._close_lock:
            if not self._stopping.is_set() and self._sockets:
                self._stopping.set()
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the KV-event publisher thread did not stop within %.1fs; it closes its sockets "
                           "when it does", timeout)

    def _close_sockets(self) -> None:
        """Closes every socket, once (a second call finds none)."""
        with self._close_lock:
            sockets, self._sockets = self._sockets, []
            for s in sockets:
                s.close(linger=0)
            if self._own_context and sockets:
                self._ctx.term()

    # ---- the publisher thread ----

    def _run(self) -> None:
        name_current_thread(THREAD_NAME)
        try:
            self._serve()
        except BaseException:
            logger.exception("the KV-event publisher thread failed; no more KV events are published")
            raise
        finally:
            self._close_sockets()

    def _serve(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_rx in ready:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if self._replay is not None and self._replay in ready:
                try:
                    self._serve_replays()
                except Exception:  # noqa: BLE001 - one failed replay; the others are still served
                    logger.exception("serving a KV-event replay failed")
            self._send_queued(encoder)
            if self._stopping.is_set():
                self._send_queued(encoder)
                return

    def _send_queued(self, encoder: msgspec.msgpack.Encoder) -> None:
        while True:
            try:
                seq, ts, log = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                batch = KVEventBatch(ts, events_from_log(log, self.block_size, self.medium), self.data_parallel_rank)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - one bad batch is lost (a gap), the thread goes on
                logger.exception("publishing KV-event batch %d failed", seq)
                continue
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
