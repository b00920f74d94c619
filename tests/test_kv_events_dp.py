"""KV-cache events with data parallelism: each engine core (its own process) publishes
on its own endpoints, offset by its rank as vLLM offsets them, and stamps its batches
with that rank. A late subscriber replays each core's events and finds the blocks of
the prompts that core served. ipc:// in a temporary folder, bounded waits."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import zmq

from pyengine import SamplingParams
from pyengine._sched import block_hashes
from pyengine.config import EngineConfig
from pyengine.kv_events.config import offset_endpoint
from pyengine.multiprocess.client import MultiprocessEngine
from pyengine.multiprocess.link_options import LinkOptions
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.kv_subscriber import SeenBlockStored, Subscriber

CPUS = sorted(os.sched_getaffinity(0))[:2]
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="data parallelism over CPUs needs two of them")
WAIT_S = 60.0


def test_each_core_publishes_on_its_own_endpoints_with_its_rank(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=9)
    replay = f"ipc://{tmp_path}/replay"
    config = EngineConfig(model=str(checkpoint), num_kv_blocks=64, block_size=4, max_num_seqs=8, data_parallel_size=2,
                          kv_events_config={"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/events",
                                            "replay_endpoint": replay})
    prompts = [[i + 3, 7, 11, i + 5, 9, 9, 2, i + 1] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = MultiprocessEngine(config, LinkOptions(core_cpus=CPUS))
    ctx = zmq.Context()
    subs: list[Subscriber] = []
    try:
        async def run_all():
            async def one(p):
                return [o async for o in engine.generate(p, params)][-1]
            return await asyncio.gather(*[one(p) for p in prompts])

        asyncio.run(run_all())
        assert all(s.generated_tokens > 0 for s in engine.engine_stats().values()), "both cores served"
        stored: dict[int, set[int]] = {}
        for rank in (0, 1):
            sub = Subscriber(ctx, None, offset_endpoint(replay, rank), b"")
            subs.append(sub)
            # The core publishes from its own thread: ask until its last batch is there.
            deadline = time.monotonic() + WAIT_S
            while True:
                sub.ask_replay(0)
                hashes = {h for b in sub.batches.values() for ev in b.events if isinstance(ev, SeenBlockStored)
                          for h in ev.block_hashes}
                if hashes or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert sub.batches and {b.data_parallel_rank for b in sub.batches.values()} == {rank}
            stored[rank] = hashes
        assert stored[0] and stored[1], "each core published its own blocks"
        every_prompt_block = {h for p in prompts for h in block_hashes(p, 4)}
        assert every_prompt_block <= stored[0] | stored[1]
    finally:
        for sub in subs:
            sub.close()
        ctx.term()
        engine.shutdown()
