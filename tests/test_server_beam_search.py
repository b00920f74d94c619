"""``use_beam_search`` on ``/v1/completions`` (through the official ``openai`` client) and
``EngineClient.beam_search``: the same beams as ``LLM.beam_search`` (which
tests/test_beam_search.py holds to transformers), fields it cannot honour refused by
name, other requests on the engine unharmed, no blocks left behind."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyengine import LLM, AsyncEngine, BeamSearchParams, EngineConfig, LinkOptions, make_engine_client
from pyengine.errors import InvalidRequestError
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer
from pyengine.testing.waits import wait_engine_idle, wait_until

EOS = [311, 135]  # tokens the tiny model emits now and then: some beams end by EOS
PROMPTS = [[257, 378, 475, 20, 74, 412, 474, 126], [363, 82, 163, 485, 212, 259, 148, 60, 214, 312]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("beam-server") / "qwen3", "qwen3", seed=3,
                                eos_token_ids=EOS)


@pytest.fixture(scope="module")
def offline(checkpoint):
    """The reference: ``LLM.beam_search`` on the same checkpoint."""
    with LLM(str(checkpoint)) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(checkpoint):
    engine = AsyncEngine(str(checkpoint), max_model_len=128)  # short: a default max_tokens searches to the end
    with LiveServer(engine, ServerArgs(model_name="tiny", stats_interval=0)) as server:
        yield server, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    server, _ = served
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0) as c:
        yield c


def test_n_beams_per_prompt_as_choices(client, offline):
    params = dict(max_tokens=12, n=3, extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                                  "return_token_ids": True})
    resp = client.completions.create(model="tiny", prompt=PROMPTS, **params)
    expected = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.5))
    assert [c.index for c in resp.choices] == list(range(6))
    reasons = set()
    for choice in resp.choices:
        seq = expected[choice.index // 3].sequences[choice.index % 3]
        extra = choice.model_extra or {}
        assert extra["token_ids"] == seq.output_token_ids
        assert extra["prompt_token_ids"] == PROMPTS[choice.index // 3]
        assert choice.text == seq.text
        assert choice.finish_reason == seq.finish_reason
        reasons.add(seq.finish_reason)
    assert reasons == {"stop", "length"}
    assert resp.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    metrics = httpx.get(f"{str(client.base_url).removesuffix('/v1/')}/metrics", timeout=30).text
    assert 'pyengine:request_success_total{finished_reason="stop",model_name="tiny"}' in metrics
    assert resp.usage.completion_tokens == sum(len(s.output_token_ids) for o in expected for s in o.sequences)


def test_text_prompt_echo_and_default_max_tokens(client, offline, served):
    _, engine = served
    resp = client.completions.create(model="tiny", prompt="hello there", n=2, max_tokens=None, echo=True,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    room = engine.max_request_tokens - len(engine.tokenize("hello there"))
    expected = offline.beam_search(["hello there"], BeamSearchParams(beam_width=2, max_tokens=room,
                                                                     ignore_eos=True))[0]
    assert [c.text for c in resp.choices] == ["hello there" + s.text for s in expected.sequences]
    assert all(c.finish_reason == "length" for c in resp.choices)


@pytest.mark.parametrize("body,param,words", [
    ({"stream": True}, "stream", "stream is not supported with use_beam_search"),
    ({"n": 7}, "n", "n must be <= 6"),  # 3 * n log-probabilities per beam (two EOS ids), max_logprobs 20
    ({"n": 0}, "n", "n must be >= 1"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ({"temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"early_stopping": "sometimes"}, "early_stopping", "early_stopping must be"),
    ({"stop": ["x"]}, "stop", "stop is not supported with use_beam_search"),
    ({"top_p": 0.5}, "top_p", "top_p is not supported"),
    ({"logprobs": 2}, "logprobs", "logprobs is not supported"),
    ({"min_tokens": 2}, "min_tokens", "min_tokens is not supported"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex", "structured_outputs.regex is not"),
    ({"response_format": {"type": "json_object"}}, "response_format", "response_format is not supported"),
    ({"best_of": 4}, "best_of", "best_of must equal n"),
    ({"prompt": [5, 10**6]}, "prompt", "beyond the vocabulary"),
])
def test_what_a_beam_search_cannot_do_is_a_400_naming_the_field(served, body, param, words):
    server, engine = served
    request = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "n": 2, "use_beam_search": True, **body}
    resp = httpx.post(f"{server.url}/v1/completions", json=request, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert wait_engine_idle(engine), engine.stats()


def test_neutral_sampling_fields_are_accepted(client):
    """Clients that send every field send top_p=1, penalties 0, ...: values that change
    nothing are not refused."""
    resp = client.completions.create(model="tiny", prompt=PROMPTS[0], n=2, max_tokens=4, top_p=1.0,
                                     presence_penalty=0.0, frequency_penalty=0.0, stop=[],
                                     extra_body={"use_beam_search": True, "top_k": -1, "min_p": 0.0,
                                                 "repetition_penalty": 1.0})
    assert len(resp.choices) == 2


def test_streaming_refusal_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model="tiny", prompt=[5, 6, 7], n=2, max_tokens=4, stream=True,
                                  extra_body={"use_beam_search": True})


def test_other_requests_are_unharmed_and_no_blocks_leak(client, served, offline):
    """A greedy completion beside a beam search gives what it gives alone."""
    _, engine = served
    alone = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True})

    async def both():
        async with openai.AsyncOpenAI(base_url=client.base_url, api_key="none", timeout=60, max_retries=0) as c:
            beams = c.completions.create(model="tiny", prompt=PROMPTS, n=4, max_tokens=16,
                                         extra_body={"use_beam_search": True, "return_token_ids": True})
            greedy = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True})
            return await asyncio.gather(beams, greedy)

    beams, beside = asyncio.run(both())
    assert beside.choices[0].model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
    expected = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=16))
    assert [c.model_extra["token_ids"] for c in beams.choices] == \
        [s.output_token_ids for o in expected for s in o.sequences]
    assert wait_engine_idle(engine), engine.stats()


def disconnects(server) -> float:
    """The server's ``request_client_disconnects`` counter."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "pyengine:request_client_disconnects" for sample in family.samples
               if sample.name.endswith("_total"))


def test_a_client_that_leaves_aborts_the_search(served):
    """The search is cancelled and counted as a disconnect (a 499), not a server error."""
    server, engine = served
    request = {"model": "tiny", "prompt": PROMPTS * 2, "n": 6, "max_tokens": 110, "ignore_eos": True,
               "use_beam_search": True}
    before = disconnects(server)
    with pytest.raises(httpx.ReadTimeout):  # 110 steps of 24 requests each: far longer than this
        httpx.post(f"{server.url}/v1/completions", json=request, timeout=0.3)
    assert wait_engine_idle(engine), "the search went on after its client left"
    assert wait_until(lambda: disconnects(server) == before + 1, 10), "the disconnect was not counted"
    resp = httpx.post(f"{server.url}/v1/completions", json={**request, "max_tokens": 2}, timeout=30)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 24


def test_engine_client_beam_search(checkpoint, offline):
    async def run():
        engine = AsyncEngine(str(checkpoint))
        try:
            got = await engine.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=10), "bs")
            with pytest.raises(InvalidRequestError, match="^beam_width must be <= 6"):
                await engine.beam_search(PROMPTS, BeamSearchParams(beam_width=7, max_tokens=10), "bad")
            assert wait_engine_idle(engine), engine.stats()
            return got
        finally:
            engine.shutdown()

    got = asyncio.run(run())
    expected = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=10))
    assert [[(s.tokens, s.text, s.finish_reason) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.text, s.finish_reason) for s in o.sequences] for o in expected]
    assert [s.cum_logprob for o in got for s in o.sequences] == \
        pytest.approx([s.cum_logprob for o in expected for s in o.sequences])


def test_without_use_beam_search_n_samples_as_always(served):
    """The beam-search fields change nothing without ``use_beam_search``."""
    server, _ = served
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "n": 2,
                                                            "max_tokens": 3, "length_penalty": 2.0}, timeout=30)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2


def test_chat_beams_as_choices(client, offline):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi there"}], n=3,
                                          max_completion_tokens=8,
                                          extra_body={"use_beam_search": True, "return_token_ids": True})
    prompt_ids = resp.model_extra["prompt_token_ids"]
    expected = offline.beam_search([prompt_ids], BeamSearchParams(beam_width=3, max_tokens=8))[0]
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in resp.choices] == [s.output_token_ids for s in expected.sequences]
    assert [c.message.content for c in resp.choices] == [s.text for s in expected.sequences]
    assert [c.finish_reason for c in resp.choices] == [s.finish_reason for s in expected.sequences]
    assert resp.usage.completion_tokens == sum(len(s.output_token_ids) for s in expected.sequences)


@pytest.mark.parametrize("body,param", [
    ({"stream": True}, "stream"),
    ({"logprobs": True}, "logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 7}, "n"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stop": "x"}, "stop"),
])
def test_chat_refusals_name_the_field(served, body, param):
    server, engine = served
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4,
               "use_beam_search": True, **body}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()
    assert wait_engine_idle(engine), engine.stats()


def test_multiprocess_engine_client_beam_search(checkpoint, offline):
    """The same search through an engine core in another process (EOS ids and
    log-probabilities cross the process link)."""
    async def run():
        engine = make_engine_client(EngineConfig.from_kwargs(str(checkpoint)), multiprocess=True,
                                    link=LinkOptions(start_timeout=120))
        try:
            assert engine.eos_token_ids == EOS
            return await engine.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                                            BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.0))
        finally:
            engine.shutdown()

    got = asyncio.run(run())
    expected = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.0))
    assert [[(s.tokens, s.finish_reason) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.finish_reason) for s in o.sequences] for o in expected]
    assert [s.score for o in got for s in o.sequences] == pytest.approx([s.score for o in expected
                                                                         for s in o.sequences])
