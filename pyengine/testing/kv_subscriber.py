"""A KV-event subscriber for tests (docs/kv_events.md): its own declarations of vLLM's
messages (array-like, tagged by class name) with no import from ``pyengine.kv_events``,
so a test checks the wire rather than our Structs against themselves; a SUB socket and a
DEALER on the replay socket, batches kept by sequence number, replayed into a set."""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import msgspec
import zmq

WAIT_S = 30.0


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class SeenBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class SeenBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class SeenAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class SeenEventBatch(_Batch):
    events: list[Union[SeenBlockStored, SeenBlockRemoved, SeenAllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=SeenEventBatch)


class Subscriber:
    """SUB on the events, DEALER on the replay socket; batches kept by sequence number."""

    def __init__(self, ctx: zmq.Context, endpoint: Optional[str], replay: Optional[str], topic: bytes) -> None:
        self.batches: dict[int, SeenEventBatch] = {}
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        if endpoint is not None:
            self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        if replay is not None:
            self.replay.connect(replay)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)

    def drain(self, timeout_ms: int = 200) -> None:
        while self.sub.poll(timeout_ms):
            _, seq, payload = self.sub.recv_multipart()
            self.batches[int.from_bytes(seq, "big")] = DECODER.decode(payload)

    def ask_replay(self, start: int) -> None:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.replay.poll(int(WAIT_S * 1000)), "no answer from the replay socket"
            empty, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return
            self.batches[int.from_bytes(seq, "big")] = DECODER.decode(payload)
        raise AssertionError("the replay did not end")

    def cached(self) -> set[int]:
        assert sorted(self.batches) == list(range(len(self.batches))), "a gap in the sequence numbers"
        held: set[int] = set()
        for seq in sorted(self.batches):
            for ev in self.batches[seq].events:
                if isinstance(ev, SeenBlockStored):
                    assert not held & set(ev.block_hashes), "a block stored twice"
                    held.update(ev.block_hashes)
                elif isinstance(ev, SeenBlockRemoved):
                    assert set(ev.block_hashes) <= held, "a block removed that was never stored"
                    held.difference_update(ev.block_hashes)
                else:
                    held.clear()
        return held
