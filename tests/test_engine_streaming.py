"""Streaming through AsyncEngine and LLM: clean text deltas, stop strings, aborts,
embeddings and logprobs."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from pyengine import LLM, AsyncEngine, EngineConfig, PoolingParams, SamplingParams
from pyengine.engine.core import EngineCore
from pyengine.testing.synthetic_runner import ScriptedRunner
from pyengine.testing.waits import wait_until

TEXT = "你好，世界！🙂👍🏽 café — ok."


@pytest.fixture(scope="module")
def scripted():
    runner = ScriptedRunner([])
    tok = runner.loaded.tokenizer
    script = tok.encode(TEXT, add_special_tokens=False).ids
    assert len(script) > len(TEXT) // 2, "the tokenizer splits multi-byte characters across tokens"
    runner.script = script
    core = EngineCore(EngineConfig(max_num_seqs=8), runner=runner)
    yield core, script
    core.shutdown()


async def collect(engine: AsyncEngine, params: SamplingParams, kind: str, rid: str):
    return [out async for out in engine.generate([5, 6, 7], params, rid, output_kind=kind)]


def test_cjk_and_emoji_deltas_are_clean_and_add_up(scripted):
    core, script = scripted
    engine = AsyncEngine.from_engine_core(core)
    params = SamplingParams(max_tokens=len(script), ignore_eos=True)
    outs = asyncio.run(collect(engine, params, "delta", "d1"))
    deltas = [o.outputs[0].text for o in outs]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == TEXT
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(script)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    cumulative = asyncio.run(collect(engine, params, "cumulative", "c1"))
    texts = [o.outputs[0].text for o in cumulative]
    assert all(TEXT.startswith(t) for t in texts) and texts[-1] == TEXT


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_truncates_and_finishes(scripted, include):
    core, script = scripted
    engine = AsyncEngine.from_engine_core(core)
    params = SamplingParams(max_tokens=len(script), ignore_eos=True, stop=["世界"],
                            include_stop_str_in_output=include)
    outs = asyncio.run(collect(engine, params, "delta", f"s{include}"))
    text = "".join(o.outputs[0].text for o in outs)
    assert text == ("你好，世界" if include else "你好，")
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "世界"
    assert len(final.token_ids) <= 3  # the delta of the last step only
    assert wait_until(lambda: core.stats().kv_usage == 0, 5, interval=0.01)


def test_llm_generate_applies_stop_strings_and_special_tokens(scripted):
    core, script = scripted
    llm = LLM.from_engine_core(core)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=len(script), ignore_eos=True, stop="café"),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == "你好，世界！🙂👍🏽 "
    assert out.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def real_engine():
    core = EngineCore(EngineConfig(max_num_seqs=16))
    yield core
    core.shutdown()


def test_abort_mid_stream_frees_blocks(real_engine):
    engine = AsyncEngine.from_engine_core(real_engine)
    params = SamplingParams(max_tokens=3000, ignore_eos=True)

    async def stop_early():
        seen = 0
        async for _ in engine.generate(list(range(3, 70)), params, "early"):
            seen += 1
            if seen == 3:
                break  # leaving the loop aborts the request
        return seen

    async def cancel_task():
        streaming = asyncio.Event()

        async def consume():
            async for _ in engine.generate(list(range(3, 70)), params, "cancelled"):
                streaming.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(streaming.wait(), 60)  # cancelled mid-stream, however loaded the machine
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def explicit_abort():
        outs = []
        async for out in engine.generate(list(range(3, 70)), params, "aborted"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("aborted")
        return outs[-1]

    assert asyncio.run(stop_early()) == 3
    asyncio.run(cancel_task())
    last = asyncio.run(explicit_abort())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    wait_until(lambda: real_engine.stats().kv_usage == 0 and not real_engine.num_unfinished(), 5, interval=0.01)
    stats = real_engine.stats()
    assert stats.kv_usage == 0 and real_engine.num_unfinished() == 0, stats


def test_logprobs_are_returned_and_add_up(real_engine):
    llm = LLM.from_engine_core(real_engine)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, logprobs=3, temperature=0.0,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) >= 3
        assert lp[token].logprob == pytest.approx(max(v.logprob for v in lp.values()))  # greedy: the most likely
        assert lp[token].rank == 1
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))


def test_embeddings_match_transformers_last_token_pooling(real_engine):
    import transformers

    llm = LLM.from_engine_core(real_engine)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
    outs = llm.embed(prompts, PoolingParams(pooling_type="last", normalize=True), use_tqdm=False)
    model = transformers.AutoModel.from_pretrained(real_engine.model_path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            hidden = model(torch.tensor([prompt])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=-1).numpy()
        got = np.array(out.outputs.embedding)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_a_fast_first_step_never_loses_the_first_token(scripted, monkeypatch):
    # The first token can be sampled before the caller has finished registering its
    # request (here made certain by a slow registration right after the scheduler's
    # add_request); the output thread must wait for it.
    core, script = scripted
    engine = AsyncEngine.from_engine_core(core)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    register = core.requests.add

    def slow_register(state):
        time.sleep(0.05)
        register(state)

    monkeypatch.setattr(core.requests, "add", slow_register)

    async def many():
        jobs = asyncio.gather(*(collect(engine, params, "cumulative", f"fast-{i}") for i in range(8)))
        return await asyncio.wait_for(jobs, timeout=30)

    for outs in asyncio.run(many()):
        assert outs[-1].outputs[0].token_ids == script[:5]
