"""The server's vLLM extras around log-probabilities and prompts: ``prompt_logprobs`` on
completions (per choice, vLLM's shape), ``echo`` with ``logprobs`` (the prompt's tokens
first), ``best_of``, ``truncate_prompt_tokens`` (completions and chat), and the 400s that
name the field. The reference is the offline API on the same engine."""

from __future__ import annotations

import httpx
import openai
import pytest

from pyengine import LLM, AsyncEngine, SamplingParams
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer

MODEL = "tiny"
PROMPT = [20, 21, 22, 40, 41, 300, 7]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("srvlp") / "qwen3", "qwen3", seed=5)
    engine = AsyncEngine(path, max_num_seqs=16, max_model_len=256)
    with LiveServer(engine, ServerArgs(model_name=MODEL, stats_interval=0)) as server:
        yield server, LLM.from_engine_core(engine.engine_core)
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="unused", timeout=30, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=30) as c:
        yield c


def test_completion_prompt_logprobs_are_vllms(served, http):
    _, llm = served
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
                        use_tqdm=False)[0].prompt_logprobs
    body = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                              "n": 2, "prompt_logprobs": 2}).json()
    for choice in body["choices"]:
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(PROMPT)
        for entry, ref in zip(got[1:], want[1:]):
            assert {int(t) for t in entry} == set(ref)
            for t, lp in entry.items():
                assert lp["logprob"] == pytest.approx(ref[int(t)].logprob, abs=1e-5)
                assert lp["rank"] == ref[int(t)].rank and lp["decoded_token"] == ref[int(t)].decoded_token
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_echo_with_logprobs_puts_the_prompt_tokens_first(served, client):
    _, llm = served
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2,
                                                 prompt_logprobs=2), use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(PROMPT) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(PROMPT)):
        assert lp.token_logprobs[j] == pytest.approx(want.prompt_logprobs[j][PROMPT[j]].logprob, abs=1e-5)
        assert 2 <= len(lp.top_logprobs[j]) <= 3
    generated = want.outputs[0]
    for got, token, ref in zip(lp.token_logprobs[len(PROMPT):], generated.token_ids, generated.logprobs):
        assert got == pytest.approx(ref[token].logprob, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert resp.choices[0].text.endswith(generated.text)


def test_best_of_returns_the_offline_apis_best_n(served, client):
    _, llm = served
    want = llm.generate([PROMPT], SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=4,
                                                 ignore_eos=True), use_tqdm=False)[0].outputs
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, best_of=4, temperature=1.0,
                                     seed=5, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.token_ids for c in resp.choices] == [c.token_ids for c in want]
    assert want[0].cumulative_logprob >= want[1].cumulative_logprob


def test_truncate_prompt_tokens_on_completions_and_chat(served, client):
    _, llm = served
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True,
                                                 "return_token_ids": True})
    assert resp.usage.prompt_tokens == 3
    direct = llm.generate([PROMPT[-3:]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert resp.choices[0].token_ids == direct.token_ids
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there " * 20}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


@pytest.mark.parametrize("body,param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"best_of": 2, "temperature": 0}, "best_of"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),
])
def test_bad_values_are_400s_naming_the_field(http, body, param):
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_chat_prompt_logprobs_cover_the_rendered_conversation(http):
    body = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
        "prompt_logprobs": 1, "return_token_ids": True}).json()
    got, ids = body["prompt_logprobs"], body["prompt_token_ids"]
    assert got[0] is None and len(got) == len(ids) == body["usage"]["prompt_tokens"]
    for token, entry in zip(ids[1:], got[1:]):
        assert str(token) in entry and 1 <= len(entry) <= 2
        assert entry[str(token)]["rank"] >= 1 and entry[str(token)]["logprob"] <= 0
    plain = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert plain["prompt_logprobs"] is None
    streamed = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
        "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
