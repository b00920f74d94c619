"""The server's logits-processor fields: OpenAI's ``logit_bias`` (string keys) on
completions and chat, vLLM's ``allowed_token_ids`` and ``bad_words``; each bad value a
400 naming its field."""

from __future__ import annotations

import httpx
import pytest

from pyengine import AsyncEngine
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("srv-procs") / "qwen3", "qwen3", seed=4)
    engine = AsyncEngine(str(checkpoint), max_num_seqs=8, num_kv_blocks=64)
    try:
        with LiveServer(engine, ServerArgs(model_name="m", chat_template=TEMPLATE, stats_interval=0)) as server:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                yield client
    finally:
        engine.shutdown()


def completion_ids(http, **fields):
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def chat_ids(http, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_logit_bias_on_completions_and_chat(http):
    assert completion_ids(http, logit_bias={"42": 100}) == [42] * 4
    assert chat_ids(http, logit_bias={"77": 100.0, "78": -100}) == [77] * 4
    plain = completion_ids(http)
    assert completion_ids(http, logit_bias={str(plain[0]): -100})[0] != plain[0]


def test_allowed_token_ids_and_bad_words(http):
    assert set(completion_ids(http, allowed_token_ids=[9, 10])) <= {9, 10}
    assert set(chat_ids(http, allowed_token_ids=[300])) == {300}
    # Two tokens allowed, one of them a banned word: the other one every time.
    allowed = [t for t in range(3, 512) if round_trips(http, t)][:2]
    for banned in allowed:
        word = http.post("/detokenize", json={"model": "m", "tokens": [banned]}).json()["prompt"]
        other = allowed[1] if banned == allowed[0] else allowed[0]
        assert completion_ids(http, allowed_token_ids=allowed, bad_words=[word]) == [other] * 4


def round_trips(http, token):
    """The token's text tokenizes back to it alone (so it can be named as a bad word)."""
    text = http.post("/detokenize", json={"model": "m", "tokens": [token]}).json()["prompt"]
    if not text.strip() or text != text.lstrip():
        return False
    return http.post("/tokenize", json={"model": "m", "prompt": text, "add_special_tokens": False}).json()["tokens"] == [token]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, 512]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["ok"] * 129}, "bad_words"),
])
def test_bad_values_are_400s_naming_the_field(http, path, fields, param):
    body = {"model": "m", "max_tokens": 2, **fields}
    body |= {"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("field, value", [("allowed_token_ids", [3]), ("bad_words", ["x"]), ("logit_bias", {"3": 1})])
def test_beam_search_refuses_the_processor_fields_naming_them(http, field, value):
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True, field: value}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
