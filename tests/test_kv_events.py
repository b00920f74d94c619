"""KV-cache events (docs/kv_events.md): a subscriber of our own, written the way vLLM's
example subscriber declares the messages, replays what the engine publishes and must hold
exactly the scheduler's cached-block set after a run with evictions and preemptions; a
late subscriber gets the same set from the replay socket. Loopback only (ipc:// in a
temporary folder), bounded waits, every socket closed."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import zmq

from pyengine import LLM, EngineConfig, SamplingParams
from pyengine._sched import block_hashes
from pyengine.errors import EngineError, InvalidConfigError
from pyengine.kv_events.config import KVEventsConfig, offset_endpoint, parse_kv_events_config
from pyengine.kv_events.publisher import KvEventPublisher
from pyengine.testing.kv_subscriber import (
    SeenAllBlocksCleared,
    SeenBlockRemoved,
    SeenBlockStored,
    SeenEventBatch,
    Subscriber,
)
from pyengine.testing.waits import wait_until

WAIT_S = 30.0


def wait_published(pub: KvEventPublisher, n: int) -> None:
    """Until the publisher thread has sent ``n`` batches (bounded)."""
    wait_until(lambda: pub.published >= n, WAIT_S, interval=0.01)
    assert pub.published >= n, f"{pub.published} of {n} batches sent within {WAIT_S}s"


def stored_ever(batches: dict[int, SeenEventBatch]) -> list[SeenBlockStored]:
    return [ev for b in batches.values() for ev in b.events if isinstance(ev, SeenBlockStored)]


# ---- configuration ----

@pytest.mark.parametrize("value, words", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', ["unknown key 'endpont'"]),
    ('{"enable_kv_cache_events": "yes"}', ["'enable_kv_cache_events'", "true or false"]),
    ('{"publisher": "kafka"}', ["'publisher'", "'zmq' or 'null'"]),
    ('{"endpoint": "localhost:5557"}', ["'endpoint'", "tcp://"]),
    ('{"replay_endpoint": "tcp://*"}', ["'replay_endpoint'", "port"]),
    ('{"buffer_steps": 0}', ["'buffer_steps'", ">= 1"]),
    ('{"max_queue_size": -1}', ["'max_queue_size'"]),
    ('{"hwm": "lots"}', ["'hwm'"]),
    ('{"enable_kv_cache_events": true,', ["not valid JSON"]),
    ('[1, 2]', ["JSON object"]),
])
def test_bad_config_is_an_error_naming_the_key(value, words):
    with pytest.raises(InvalidConfigError) as e:
        EngineConfig(kv_events_config=value)
    assert "kv_events_config" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_config_defaults_are_vllms_and_need_the_prefix_cache():
    c = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert c == KVEventsConfig(True, "zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert c.active
    assert not parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}).active
    assert parse_kv_events_config({}).publisher == "null"
    with pytest.raises(InvalidConfigError, match="enable_prefix_caching"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True}, enable_prefix_caching=False)
    # Plain data: the checked dict, which crosses to a core process as JSON.
    config = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.kv_events_config["topic"] == "kv" and config.kv_events == parse_kv_events_config(
        config.kv_events_config)


def test_the_flag_is_vllms_spelling():
    import argparse

    from pyengine.cli.engine_flags import add_engine_flags, engine_kwargs

    parser = argparse.ArgumentParser()
    names = add_engine_flags(parser)
    ns = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert engine_kwargs(ns, names) == {"kv_events_config": '{"enable_kv_cache_events": true}'}


def test_endpoints_are_offset_by_the_data_parallel_rank_as_vllm_does():
    ports = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    EngineConfig(kv_events_config=ports)  # one core: fine
    with pytest.raises(InvalidConfigError, match="'replay_endpoint' port 5558 .* collide"):
        EngineConfig(kv_events_config=ports, data_parallel_size=2)
    EngineConfig(kv_events_config={**ports, "replay_endpoint": "tcp://*:5567"}, data_parallel_size=2)
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint(None, 3) is None


# ---- hashes ----

def test_published_hashes_follow_the_documented_chain():
    """The algorithm of docs/kv_events.md, computed here with the system's libxxhash
    (an implementation independent of ours): XXH3-128 over a tag byte, the parent's 16
    bytes (or the salt), the token ids as u32 little-endian; the low 64 bits published."""
    path = ctypes.util.find_library("xxhash")
    if path is None:
        reason = "libxxhash is not installed (Debian: libxxhash0; `make install-libxxhash`)"
        if os.environ.get("PYENGINE_REQUIRE_LIBXXHASH") == "1":
            pytest.fail(f"PYENGINE_REQUIRE_LIBXXHASH=1 but {reason}")
        pytest.skip(reason)
    lib = ctypes.CDLL(path)

    class Hash128(ctypes.Structure):
        _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]

    lib.XXH3_128bits.restype = Hash128
    lib.XXH3_128bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

    def xxh3_128(data: bytes) -> int:
        h = lib.XXH3_128bits(data, len(data))
        return (h.high64 << 64) | h.low64

    def chain(tokens: list[int], bs: int, salt: Optional[str]) -> list[int]:
        out, parent = [], None
        for i in range(len(tokens) // bs):
            ids = struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs])
            if parent is None:
                head = b"\x00" + (struct.pack("<Q", len(salt.encode())) + salt.encode() if salt else b"")
            else:
                head = b"\x01" + parent.to_bytes(16, "little")
            parent = xxh3_128(head + ids)
            out.append(parent & (2**64 - 1))
        return out

    tokens = [5, 900, 17, 3, 3, 3, 41, 8, 1, 2, 7]
    for salt in (None, "tenant-a"):
        assert block_hashes(tokens, 4, salt) == chain(tokens, 4, salt)
    assert block_hashes(tokens, 4)[0] != block_hashes(tokens, 4, "tenant-a")[0]


# ---- the publisher alone ----

def _log(kinds, hashes, parents, tokens):
    return (np.array(kinds, np.uint8), np.array(hashes, np.uint64), np.array(parents, np.uint64),
            np.array(tokens, np.uint32))


def test_publisher_batches_chains_carries_its_rank_and_closes(tmp_path):
    ctx = zmq.Context()
    base = f"ipc://{tmp_path}/ev"
    sub = Subscriber(ctx, offset_endpoint(base, 1), offset_endpoint(f"ipc://{tmp_path}/rp", 1), b"")
    pub = KvEventPublisher(parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": base,
                                                   "replay_endpoint": f"ipc://{tmp_path}/rp"}),
                           block_size=2, medium="CPU", data_parallel_rank=1)
    try:
        assert pub.endpoint == f"{base}_dp1"
        # root 10, child 11 of 10, child 12 of 11; an unrelated child 20 of 99; two removals; a clear.
        pub.publish(_log([0, 1, 1, 1, 2, 2, 3], [10, 11, 12, 20, 11, 12, 0], [0, 10, 11, 99, 0, 0, 0],
                         [1, 2, 3, 4, 5, 6, 7, 8]))
        wait_published(pub, 1)
        sub.ask_replay(0)  # the slow-joiner-proof way to read batch 0
        batch = sub.batches[0]
        assert batch.data_parallel_rank == 1
        assert batch.events == [
            SeenBlockStored([10, 11, 12], None, [1, 2, 3, 4, 5, 6], 2, None, "CPU"),
            SeenBlockStored([20], 99, [7, 8], 2, None, "CPU"),
            SeenBlockRemoved([11, 12], "CPU"),
            SeenAllBlocksCleared(),
        ]
    finally:
        pub.close()
        sub.close()
        ctx.term()
    assert pub._sockets == [] and not pub._thread.is_alive()


def test_a_full_queue_drops_and_counts_and_leaves_a_gap(tmp_path):
    ctx = zmq.Context()
    replay = f"ipc://{tmp_path}/rp"
    sub = Subscriber(ctx, None, replay, b"")
    pub = KvEventPublisher(parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev",
                                                   "replay_endpoint": replay, "max_queue_size": 1}),
                           block_size=1, medium="CPU")
    release = __import__("threading").Event()
    send = pub._send_queued
    pub._send_queued = lambda enc: (release.wait(WAIT_S), send(enc))  # a stalled publisher thread
    try:
        for h in (1, 2, 3):
            pub.publish(_log([0], [h], [0], [h]))  # returns at once although nothing is sent
        assert pub.dropped == 2
        release.set()
        wait_published(pub, 1)  # the queue has room again
        pub.publish(_log([2], [1], [0], []))  # seq 3
        wait_published(pub, 2)
        sub.ask_replay(0)
        assert sorted(sub.batches) == [0, 3], "batches 1 and 2 were dropped: a visible gap"
    finally:
        release.set()
        pub.close()
        sub.close()
        ctx.term()


def test_a_replay_longer_than_zmqs_default_high_water_mark_arrives_whole(tmp_path):
    """A ROUTER drops silently past its send high-water mark (1000 by default): a replay of
    the whole buffer, and its end marker, must all arrive. Each batch carries a few KiB
    (four 128-token blocks), more than the kernel's socket buffers hold in all, so the
    ROUTER's pipe does fill while the subscriber has not read."""
    n, bs = 3000, 128
    ctx = zmq.Context()
    replay = f"ipc://{tmp_path}/rp"
    sub = Subscriber(ctx, None, replay, b"")
    pub = KvEventPublisher(parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev",
                                                   "replay_endpoint": replay, "buffer_steps": n}),
                           block_size=bs, medium="CPU")
    try:
        for h in range(n):
            pub.publish(_log([0, 0, 0, 0], [4 * h + 1, 4 * h + 2, 4 * h + 3, 4 * h + 4], [0] * 4,
                             [100_000 + t for t in range(4 * bs)]))
        wait_published(pub, n)
        sub.ask_replay(0)  # fails on a missing end marker
        assert sorted(sub.batches) == list(range(n))
    finally:
        pub.close()
        sub.close()
        ctx.term()


def test_a_failed_or_malformed_replay_request_leaves_the_publisher_serving(tmp_path, caplog):
    ctx = zmq.Context()
    replay = f"ipc://{tmp_path}/rp"
    sub = Subscriber(ctx, None, replay, b"")
    pub = KvEventPublisher(parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev",
                                                   "replay_endpoint": replay}), block_size=1, medium="CPU")
    serve = pub._serve_replays
    failures = [RuntimeError("a replay that fails")]

    def failing_once():
        if failures:  # fails mid-replay: the request read, no answer sent
            pub._replay.recv_multipart()
            raise failures.pop()
        serve()

    pub._serve_replays = failing_once
    try:
        pub.publish(_log([0], [7], [0], [7]))
        wait_published(pub, 1)
        sub.replay.send_multipart([b"", (0).to_bytes(8, "big")])  # meets the failure: no answer
        wait_deadline = time.monotonic() + WAIT_S
        while failures and time.monotonic() < wait_deadline:
            time.sleep(0.01)
        assert not failures
        sub.replay.send_multipart([b"", b"not eight bytes long"])  # malformed: ignored
        sub.ask_replay(0)
        assert sorted(sub.batches) == [0] and pub._thread.is_alive()
        assert "serving a KV-event replay failed" in caplog.text
        assert "malformed KV-event replay request" in caplog.text
    finally:
        pub.close()
        sub.close()
        ctx.term()
    assert pub._sockets == [] and not pub._thread.is_alive()


def test_close_after_a_join_timeout_still_closes_every_socket_once(tmp_path):
    pub = KvEventPublisher(parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev",
                                                   "replay_endpoint": f"ipc://{tmp_path}/rp"}),
                           block_size=1, medium="CPU")
    release = __import__("threading").Event()
    send = pub._send_queued
    pub._send_queued = lambda enc: (release.wait(WAIT_S), send(enc))  # a stalled publisher thread
    try:
        pub.publish(_log([0], [1], [0], [1]))
        pub.close(timeout=0.05)
        assert pub._thread.is_alive() and pub._sockets, "not closed under the running thread"
        pub.publish(_log([0], [2], [0], [2]))  # an output thread that outlived shutdown: no error
    finally:
        release.set()
    pub._thread.join(WAIT_S)
    assert not pub._thread.is_alive() and pub._sockets == [], "the thread closed them as it ended"
    pub.close()  # again: nothing left to do
    pub.publish(_log([0], [3], [0], [3]))  # after close: dropped, no error
    assert pub._sockets == []


# ---- the engine ----

def _prompts() -> list[list[int]]:
    """Three shared stems (prefix hits) with distinct tails; enough blocks to evict."""
    stems = [[(t * 7 + s) % 200 + 3 for t in range(16)] for s in range(3)]
    return [stems[i % 3] + [300 + i * 5 + t for t in range(4 + i % 7)] for i in range(18)]


def test_a_subscriber_ends_with_the_engines_cached_blocks(tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    ctx = zmq.Context()
    live = Subscriber(ctx, endpoint, replay, b"kv")
    late = None
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}
    try:
        with LLM(num_kv_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                 kv_events_config=config) as llm:
            core = llm.engine_core
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            llm.generate(_prompts(), params, use_tqdm=False)
            stats = core.stats()
            assert stats.preemptions > 0, "the run must preempt"
            expected = set(core.sched.cached_block_hashes())
            last = core.kv_publisher._next_seq - 1
            # Every batch queued so far is sent (bounded wait), then the live subscriber
            # reads what reached it and asks the replay socket for anything it missed (the
            # first batches can go out before its subscription reached the PUB socket).
            wait_published(core.kv_publisher, last + 1)
            live.drain()
            missing = [s for s in range(last + 1) if s not in live.batches]
            if missing:
                live.ask_replay(missing[0])
            assert sorted(live.batches) == list(range(last + 1))
            assert core.kv_publisher.dropped == 0
            assert live.cached() == expected and expected
            removed = [ev for b in live.batches.values() for ev in b.events if isinstance(ev, SeenBlockRemoved)]
            assert removed, "the run must evict cached blocks"
            # Each prompt's full blocks were stored under the hashes anyone can compute.
            ever = {h for ev in stored_ever(live.batches) for h in ev.block_hashes}
            for p in _prompts():
                assert set(block_hashes(p, 4)) <= ever
            for ev in stored_ever(live.batches):
                assert len(ev.token_ids) == 4 * len(ev.block_hashes) and ev.block_size == 4
                if ev.parent_block_hash is None:
                    assert block_hashes(ev.token_ids, 4)[:len(ev.block_hashes)] == ev.block_hashes
            # A subscriber that comes late asks for everything from 0.
            late = Subscriber(ctx, None, replay, b"kv")
            late.ask_replay(0)
            assert late.cached() == expected
            assert sorted(late.batches) == list(range(last + 1))
    finally:
        live.close()
        if late is not None:
            late.close()
        ctx.term()


def _open_sockets() -> int:
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:  # closed meanwhile
            continue
    return count


def test_off_by_default_no_publisher_no_recording():
    sockets = _open_sockets()
    with LLM(num_kv_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=32) as llm:
        assert _open_sockets() == sockets, "no socket opened"
        core = llm.engine_core
        assert core.kv_publisher is None
        assert core.output.kv_events is None
        assert core.sched.config.enable_kv_events is False
        llm.generate([list(range(3, 20))], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert core.sched.cached_block_hashes(), "the prefix cache works; only its events are off"


def test_an_endpoint_in_use_is_a_clear_error_and_leaves_nothing_open(tmp_path):
    import socket

    with socket.socket() as s:  # a free loopback port, held by the first publisher below
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/a",
                                     "replay_endpoint": f"tcp://127.0.0.1:{port}"})
    first = KvEventPublisher(config, block_size=4, medium="CPU")
    try:
        other = parse_kv_events_config({**config.__dict__, "endpoint": f"ipc://{tmp_path}/b"})
        with pytest.raises(EngineError, match=f"replay_endpoint 'tcp://127.0.0.1:{port}'"):
            KvEventPublisher(other, block_size=4, medium="CPU")
    finally:
        first.close()
    assert first._sockets == []
