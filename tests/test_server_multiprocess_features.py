"""What the server does beyond plain sampling, through the multi-process engine
(``pyengine serve``'s default): beam search, prompt log-probabilities and streamed text,
each compared with the offline ``LLM`` on the same checkpoint. The streamed text here is
made in the front end from the ids the core sends (``front_text.py``); the offline text
is made in the engine."""

from __future__ import annotations

import json

import httpx
import pytest

from pyengine import (
    LLM,
    BeamSearchParams,
    EngineConfig,
    SamplingParams,
    make_engine_client,
)
from pyengine.server.args import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer

MODEL = "tiny"
PROMPTS = [[257, 378, 475, 20, 74, 412, 474, 126], [363, 82, 163, 485, 212, 259, 148, 60, 214, 312]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mpfeatures") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="module")
def offline(checkpoint):
    with LLM(str(checkpoint), max_model_len=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def http(checkpoint):
    engine = make_engine_client(EngineConfig.from_kwargs(str(checkpoint), max_num_seqs=16, max_model_len=256),
                                multiprocess=True)
    try:
        with LiveServer(engine, ServerArgs(model_name=MODEL, stats_interval=0)) as server:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                yield client
    finally:
        engine.shutdown()


def test_beam_search(http, offline):
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 10, "n": 3, "use_beam_search": True,
            "return_token_ids": True}
    got = http.post("/v1/completions", json=body).json()
    want = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=10))
    assert [c["index"] for c in got["choices"]] == list(range(6)), got
    for choice in got["choices"]:
        seq = want[choice["index"] // 3].sequences[choice["index"] % 3]
        assert (choice["token_ids"], choice["text"]) == (seq.output_token_ids, seq.text)


def test_prompt_logprobs(http, offline):
    want = offline.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
                            use_tqdm=False)[0].prompt_logprobs
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    got = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPTS[0])
    for entry, ref in zip(got[1:], want[1:]):
        assert {int(t) for t in entry} == set(ref)
        for t, lp in entry.items():
            assert lp["logprob"] == pytest.approx(ref[int(t)].logprob, abs=1e-5)
            assert (lp["rank"], lp["decoded_token"]) == (ref[int(t)].rank, ref[int(t)].decoded_token)


def _streamed(http, body) -> tuple[str, list[int], str]:
    text, ids, reason = [], [], None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                ids.extend(choice.get("token_ids") or [])
                reason = choice["finish_reason"] or reason
    return "".join(text), ids, reason


@pytest.mark.parametrize("fields", [
    dict(max_tokens=24, ignore_eos=True),
    dict(max_tokens=24, ignore_eos=True, skip_special_tokens=False),
    dict(max_tokens=24, stop_token_ids="fifth"),
    dict(max_tokens=24, stop_token_ids="fifth", include_stop_str_in_output=True, skip_special_tokens=False),
], ids=["length", "specials", "stop token", "stop token kept"])
def test_streamed_text_equals_the_offline_engines(http, offline, fields):
    greedy = offline.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    if fields.get("stop_token_ids") == "fifth":
        fields = {**fields, "stop_token_ids": [greedy[4]]}
    want = offline.generate([PROMPTS[1]], SamplingParams(temperature=0.0, **fields), use_tqdm=False)[0].outputs[0]
    text, ids, reason = _streamed(http, {"model": MODEL, "prompt": PROMPTS[1], "temperature": 0, **fields})
    assert (text, ids, reason) == (want.text, want.token_ids, want.finish_reason)
