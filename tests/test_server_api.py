"""The OpenAI-compatible server through the official ``openai`` client, on a live
uvicorn server (127.0.0.1, free port) over a tiny checkpoint: completions, chat,
streaming, n > 1, logprobs, stop, seed, embeddings, and greedy parity with the offline
``LLM.generate`` on the same engine — also for 200 concurrent streams."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from pyengine import LLM, AsyncEngine, SamplingParams
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    engine = AsyncEngine(path, max_num_seqs=256, max_model_len=512, num_kv_blocks=1024)
    with LiveServer(engine, ServerArgs(model_name=MODEL, stats_interval=0)) as server:
        yield server, engine, LLM.from_engine_core(engine.engine_core)
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    server, _, _ = served
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=30, max_retries=0) as c:
        yield c


def offline(llm: LLM, prompts, **params):
    outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def wait_idle(engine: AsyncEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.kv_usage == 0 and s.num_running == 0 and s.num_waiting == 0 and s.queue_depths["requests"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_greedy_completion_matches_offline_tokens_and_text(served, client):
    _, _, llm = served
    prompts = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 99, 250, 7]]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    expected = offline(llm, prompts, max_tokens=12, temperature=0, ignore_eos=True)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice, want in zip(resp.choices, expected):
        assert choice.token_ids == want.token_ids
        assert choice.text == want.text
        assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == 12 and resp.usage.completion_tokens == 36
    assert resp.model == MODEL and resp.object == "text_completion"


def test_text_prompt_echo_and_stop(served, client):
    _, _, llm = served
    full = offline(llm, ["Hello world"], max_tokens=16, temperature=0, ignore_eos=True)[0].text
    stop = full[4:6]
    assert stop and stop not in full[:4]
    resp = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=16, temperature=0, stop=[stop],
                                     echo=True, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == "Hello world" + full[:full.index(stop)]


def test_streaming_completion_adds_up_to_the_whole(served, client):
    _, _, llm = served
    want = offline(llm, [[9, 8, 7]], max_tokens=10, temperature=0, ignore_eos=True)[0]
    chunks = list(client.completions.create(model=MODEL, prompt=[9, 8, 7], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == 3


def test_n_samples_seeded_and_reproducible(client):
    def sample():
        resp = client.completions.create(model=MODEL, prompt=[11, 12, 13], n=3, max_tokens=8, temperature=1.0,
                                         seed=42, extra_body={"ignore_eos": True, "return_token_ids": True})
        return [tuple(c.token_ids) for c in sorted(resp.choices, key=lambda c: c.index)]

    first, second = sample(), sample()
    assert len(first) == 3 and first == second
    assert len(set(first)) > 1, "the n samples should differ"


def test_several_prompts_with_n_samples_are_ordered_prompt_major(served, client):
    _, _, llm = served
    prompts = [[30, 31], [32, 33, 34]]
    resp = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    expected = offline(llm, prompts, max_tokens=4, temperature=0, ignore_eos=True)
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in choices] == [expected[0].token_ids] * 2 + [expected[1].token_ids] * 2
    assert [c.prompt_token_ids for c in choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 16


def test_completion_logprobs(served, client):
    _, _, llm = served
    want = offline(llm, [[20, 21, 22]], max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)[0]
    resp = client.completions.create(model=MODEL, prompt=[20, 21, 22], max_tokens=5, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(t.startswith("bytes:") or t in resp.choices[0].text for t in lp.tokens)
    for got, token, ref in zip(lp.token_logprobs, want.token_ids, want.logprobs):
        assert got == pytest.approx(ref[token].logprob, abs=1e-4)  # the offline API returns vLLM's Logprob
    for top, ref in zip(lp.top_logprobs, want.logprobs):
        assert 3 <= len(top) <= 4  # the top 3 plus the sampled token if it is not among them
        assert max(top.values()) == pytest.approx(max(v.logprob for v in ref.values()), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_uses_the_chat_template(served, client):
    server, engine, llm = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    ids = engine.tokenizer.encode(rendered, add_special_tokens=False).ids
    want = offline(llm, [ids], max_tokens=8, temperature=0, ignore_eos=True)[0]
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 8
    content = choice.logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", "replace") == want.text


def test_chat_streaming_sends_role_then_content(client):
    messages = [{"role": "user", "content": "Count to three."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_embeddings_match_offline(served, client):
    _, _, llm = served
    resp = client.embeddings.create(model=MODEL, input=["the quick brown fox", "hello"])
    want = llm.embed(["the quick brown fox", "hello"], use_tqdm=False)
    assert [d.index for d in resp.data] == [0, 1]
    for got, ref in zip(resp.data, want):
        assert got.embedding == pytest.approx(ref.outputs.embedding, abs=1e-5)
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in want)


def test_models_and_version(served, client):
    server, _, _ = served
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/version", timeout=5).json()["version"]


def test_200_concurrent_streams_match_offline_greedy_and_free_the_pool(served):
    server, engine, llm = served
    prompts = [[(7 * i) % 400 + 3, (13 * i) % 400 + 3, i % 50 + 3, 17] for i in range(200)]
    expected = offline(llm, prompts, max_tokens=6, temperature=0, ignore_eos=True)

    async def run() -> list[tuple[list[int], str]]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=2.0)
        async with httpx.AsyncClient(limits=limits, timeout=30) as http, \
                openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", http_client=http, max_retries=0) as c:
            gate = asyncio.Semaphore(64)

            async def one(prompt: list[int]) -> tuple[list[int], str]:
                async with gate:
                    stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                        stream=True,
                                                        extra_body={"ignore_eos": True, "return_token_ids": True})
                    ids: list[int] = []
                    text = ""
                    async for chunk in stream:
                        if chunk.choices:
                            ids += chunk.choices[0].token_ids or []
                            text += chunk.choices[0].text
                    return ids, text

            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=60)

    results = asyncio.run(run())
    assert [ids for ids, _ in results] == [e.token_ids for e in expected]
    assert [text for _, text in results] == [e.text for e in expected]
    wait_idle(engine)
