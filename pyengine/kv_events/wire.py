"""KV-cache events as vLLM publishes them: msgspec Structs encoded as msgpack arrays
(``array_like``), each event tagged with its class name, in a batch with a timestamp
and the publishing core's data-parallel rank.

The field order is vLLM's (``vllm/distributed/kv_events.py`` and its
``examples/online_serving/kv_events_subscriber.py``), so the same Structs decode ours.
``batch_from_log`` turns the scheduler's flat log (``OutputEvent.kv_events``) into
events, merging a run of stored blocks that chain onto each other into one
``BlockStored`` (as vLLM sends a request's new blocks) and consecutive removals into one
``BlockRemoved``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

# Event kinds in the scheduler's log (rust_sched/sched/src/kv_events.rs).
STORED_ROOT, STORED_CHILD, REMOVED, ALL_CLEARED = 0, 1, 2, 3


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag (the class name) is each one's first element."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def events_from_log(log: tuple, block_size: int, medium: str) -> list[KVCacheEvent]:
    """The events of one ``OutputEvent.kv_events`` log ``(kinds, hashes, parents, tokens)``."""
    kinds, hashes, parents, tokens = (a.tolist() for a in log)
    events: list[KVCacheEvent] = []
    stored = 0  # stored events seen so far: the next one's tokens start at stored * block_size
    for kind, h, parent in zip(kinds, hashes, parents):
        last = events[-1] if events else None
        if kind in (STORED_ROOT, STORED_CHILD):
            block = tokens[stored * block_size:(stored + 1) * block_size]
            stored += 1
            if kind == STORED_CHILD and isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
                last.block_hashes.append(h)
                last.token_ids.extend(block)
                continue
            events.append(BlockStored([h], parent if kind == STORED_CHILD else None, block, block_size, None, medium))
        elif kind == REMOVED:
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(h)
            else:
                events.append(BlockRemoved([h], medium))
        elif kind == ALL_CLEARED:
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event kind {kind}")
    return events


def apply_events(cached: set[int], events: list[KVCacheEvent]) -> None:
    """What a subscriber does with a batch's events: the set of hashes it believes cached."""
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cached.clear()
