"""Data parallelism: ``data_parallel_size`` engine cores behind one front end, for real.

Each core gets its own CPU (affinity and torch threads), requests are spread by load and
come back the same as from one engine, ``/metrics`` labels each core's series and
``/health`` lists every core; a killed core fails only its own requests in flight, and
the front end then answers 503. Needs two CPUs."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pyengine import SamplingParams
from pyengine.config import EngineConfig
from pyengine.errors import EngineDeadError
from pyengine.multiprocess.client import MultiprocessEngine
from pyengine.multiprocess.link_options import LinkOptions
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer
from pyengine.testing.waits import wait_until

CPUS = sorted(os.sched_getaffinity(0))[:2]
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="data parallelism over CPUs needs two of them")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dp") / "qwen3", "qwen3", seed=9)


def _allowed_cpus(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":")[1].strip()
    raise AssertionError("no Cpus_allowed_list")


async def _run(engine, prompt, params):
    return [o async for o in engine.generate(prompt, params)][-1]


def test_two_cores_share_the_work_and_answer_as_one(checkpoint):
    config = EngineConfig(model=str(checkpoint), num_kv_blocks=128, max_num_seqs=16, data_parallel_size=2)
    single = MultiprocessEngine(EngineConfig(model=str(checkpoint), num_kv_blocks=128, max_num_seqs=16))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [[i + 3, 7, 11, i + 5] for i in range(8)]

        async def all_of(engine):
            return await asyncio.gather(*[_run(engine, p, params) for p in prompts])

        expected = [o.outputs[0].token_ids for o in asyncio.run(all_of(single))]
    finally:
        single.shutdown()
    engine = MultiprocessEngine(config, LinkOptions(core_cpus=CPUS))
    try:
        pids = engine.core_pids
        assert sorted(_allowed_cpus(pid) for pid in pids) == sorted(str(c) for c in CPUS)
        got = [o.outputs[0].token_ids for o in asyncio.run(all_of(engine))]
        assert got == expected
        per_core = engine.engine_stats()
        assert sorted(per_core) == [0, 1] and all(s.generated_tokens > 0 for s in per_core.values())  # both worked
        assert engine.stats().generated_tokens == sum(s.generated_tokens for s in per_core.values())
        with LiveServer(engine, ServerArgs(model_name="dp", stats_interval=0)) as server:
            metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
            for index in ("0", "1"):
                assert f'pyengine:engine_steps_total{{engine="{index}",model_name="dp"}}' in metrics
                assert f'pyengine:thread_busy_seconds_total{{engine="{index}",model_name="dp",thread="pyengine-exec"}}' \
                    in metrics
            health = httpx.get(f"{server.url}/health", timeout=30)
            assert health.status_code == 200 and [e["engine"] for e in health.json()["engines"]] == [0, 1]

            async def killed_one():
                long = SamplingParams(max_tokens=1500, ignore_eos=True)
                counts = [0] * 4

                async def one(i):
                    async for out in engine.generate([i + 1, 2, 3], long, output_kind="delta"):
                        counts[i] += len(out.outputs[0].token_ids)

                streams = [asyncio.ensure_future(one(i)) for i in range(4)]
                deadline = time.monotonic() + 30
                while min(counts) == 0 and time.monotonic() < deadline:  # every stream is running
                    await asyncio.sleep(0.02)
                os.kill(pids[1], signal.SIGKILL)
                while sum(t.done() for t in streams) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                dead = [t for t in streams if t.done() and isinstance(t.exception(), EngineDeadError)]
                others = [i for i, t in enumerate(streams) if t not in dead]
                seen = {i: counts[i] for i in others}
                # Core 0's streams are unharmed: each goes on producing (or finished cleanly).
                while time.monotonic() < deadline and not all(
                        counts[i] > seen[i] or (streams[i].done() and streams[i].exception() is None)
                        for i in others):
                    await asyncio.sleep(0.02)
                unharmed = [i for i in others if counts[i] > seen[i] or (streams[i].done()
                                                                         and streams[i].exception() is None)]
                for i in others:  # abort them now
                    streams[i].cancel()
                await asyncio.gather(*streams, return_exceptions=True)
                return len(dead), len(unharmed)

            dead, untouched = asyncio.run(killed_one())
            assert dead == 2 and untouched == 2  # the least-loaded balance put two on each core
            assert wait_until(lambda: httpx.get(f"{server.url}/health", timeout=30).status_code == 503, 5, interval=0.1)
            body = httpx.get(f"{server.url}/health", timeout=30).json()
            assert [e["alive"] for e in body["engines"]] == [True, False] and "SIGKILL" in body["reason"]
            assert [e["engine"] for e in body["engines"]] == [0, 1]
            # One dead core does not take the live one's figures off /metrics.
            metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
            assert 'pyengine:engine_steps_total{engine="0",model_name="dp"}' in metrics
            assert 'pyengine:thread_busy_seconds_total{engine="0",model_name="dp",thread="pyengine-exec"}' in metrics
            assert 'pyengine:engine_steps_total{engine="1"' not in metrics
            assert 'pyengine:engine_alive{engine="0",model_name="dp"} 1.0' in metrics
            assert 'pyengine:engine_alive{engine="1",model_name="dp"} 0.0' in metrics
            assert sorted(engine.engine_stats()) == [0]
    finally:
        engine.shutdown()
    assert all(not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
               for pid in pids)
