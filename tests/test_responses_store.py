"""The Responses API's store is bounded: least recently used entries go first past its
count or its bytes (the encoded bytes it holds), one entry heavier than the whole budget
is not kept, 0 keeps none."""

from __future__ import annotations

import msgspec
import pytest

from pyengine.errors import InvalidConfigError
from pyengine.server import ServerArgs
from pyengine.server.responses.store import ResponseStore


def entry(n: int, text: str = "x") -> tuple[dict, list]:
    return {"id": f"resp_{n}", "output_text": text}, [{"role": "user", "content": text}]


def weight(n: int, text: str = "x") -> int:
    response, history = entry(n, text)
    return len(msgspec.json.encode(response)) + len(msgspec.json.encode(history))


def test_count_bound_evicts_least_recently_used():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for n in (1, 2):
        assert store.put(f"resp_{n}", *entry(n))
    assert store.get("resp_1") is not None  # used: now resp_2 is the oldest
    store.put("resp_3", *entry(3))
    assert store.get("resp_2") is None
    assert store.get("resp_1").history == [{"role": "user", "content": "x"}]
    assert len(store) == 2 and store.bytes == weight(1) + weight(3)


def test_byte_bound_and_an_entry_too_heavy_to_keep():
    budget = 2 * weight(1) + 1
    store = ResponseStore(max_entries=100, max_bytes=budget)
    for n in (1, 2, 3):
        store.put(f"resp_{n}", *entry(n))
    assert [store.get(f"resp_{n}") is not None for n in (1, 2, 3)] == [False, True, True]
    assert store.bytes <= budget
    assert not store.put("resp_big", *entry(9, "y" * budget))
    assert store.get("resp_big") is None and len(store) == 2


def test_replacing_an_entry_counts_it_once():
    store = ResponseStore(max_entries=4, max_bytes=10_000)
    store.put("resp_1", *entry(1))
    store.put("resp_1", *entry(1, "longer text"))
    assert len(store) == 1 and store.bytes == weight(1, "longer text")


def test_size_zero_keeps_nothing_and_bad_bounds_are_refused():
    store = ResponseStore(max_entries=0, max_bytes=10_000)
    assert not store.put("resp_1", *entry(1)) and store.get("resp_1") is None
    with pytest.raises(InvalidConfigError, match="responses_store_size"):
        ServerArgs(responses_store_size=-1)


def test_the_byte_bound_is_the_encoded_bytes_held_and_reads_are_copies():
    text = "é" * 50  # 100 bytes of UTF-8
    store = ResponseStore(max_entries=10, max_bytes=10_000)
    store.put("resp_1", *entry(1, text))
    store.put("resp_2", *entry(2))
    held = [store.get(f"resp_{n}") for n in (1, 2)]
    assert all(isinstance(e.response_json, bytes) and isinstance(e.history_json, bytes) for e in held)
    assert store.bytes == sum(len(e.response_json) + len(e.history_json) for e in held)
    assert held[0].size == weight(1, text) and held[0].size > 2 * len(text), "bytes, not characters"
    response, history = entry(1, text)
    assert held[0].response == response and held[0].history == history
    held[0].history.append({"role": "user", "content": "more"})  # a follow-up extending what it read
    assert store.get("resp_1").history == history
    tight = ResponseStore(max_entries=10, max_bytes=weight(1, text) - 1)
    assert not tight.put("resp_1", *entry(1, text)), "one byte over the budget"
