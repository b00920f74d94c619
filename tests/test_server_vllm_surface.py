"""The server's surface as vLLM users know it: the served name (the model argument as
given, ``--served-model-name``), ``GET /v1/models/{id}``, ``/tokenize`` / ``/detokenize``,
``/ping``, text-only content parts, the chat template's sources (``--chat-template``,
``chat_template.jinja``, tokenizer_config.json) and vLLM's flag spellings. A synthetic
engine keeps most of it fast; one tiny checkpoint covers the template files."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pyengine import AsyncEngine
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.inputs.chat_template import checkpoint_chat_template, load_chat_template
from pyengine.models.default_tokenizer import CHAT_TEMPLATE
from pyengine.server import ServerArgs
from pyengine.server.cli import parse, uvicorn_log_level
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer
from pyengine.testing.synthetic_runner import SleepRunner

NAME = "org/model-7b"  # a hub id, slash included
KEY = "secret"
# Plain text, no special tokens: what it renders is easy to tokenize by hand.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def synthetic():
    engine = AsyncEngine.from_engine_core(EngineCore(EngineConfig(max_num_seqs=8), runner=SleepRunner(0.001)))
    args = ServerArgs(model_name=NAME, model_aliases=("alias",), chat_template=TEMPLATE, api_key=KEY,
                      stats_interval=0)
    with LiveServer(engine, args) as server:
        yield server, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(synthetic):
    server, _ = synthetic
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=30, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(synthetic):
    server, _ = synthetic
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


# ---- command line ----


def test_served_name_defaults_to_the_model_argument_as_given():
    assert parse(["Qwen/Qwen3-0.6B"])[2].model_name == "Qwen/Qwen3-0.6B"
    assert parse(["/models/ckpt/"])[2].model_name == "/models/ckpt/"
    assert parse([])[2].model_name == "pyengine-tiny"
    args = parse(["/models/ckpt", "--served-model-name", "gpt", "gpt-alias"])[2]
    assert (args.model_name, args.model_aliases, args.model_names) == ("gpt", ("gpt-alias",), ("gpt", "gpt-alias"))


def test_vllm_flag_spellings():
    assert parse([])[2].log_requests is True
    assert parse(["--disable-log-requests"])[2].log_requests is False
    assert parse(["--no-log-requests"])[2].log_requests is False
    assert parse(["--enable-log-requests"])[2].log_requests is True
    with pytest.raises(SystemExit):
        parse(["--enable-log-requests", "--disable-log-requests"])
    assert uvicorn_log_level(parse(["--log-level", "INFO"])[2]) == "info"
    assert uvicorn_log_level(parse(["--log-level", "info", "--uvicorn-log-level", "warning"])[2]) == "warning"
    with pytest.raises(SystemExit):
        parse(["--uvicorn-log-level", "loud"])


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path):
    file = tmp_path / "tmpl.jinja"
    file.write_text(TEMPLATE)
    assert parse(["--chat-template", str(file)])[2].chat_template == TEMPLATE
    # The text itself; "\n" typed on a command line is a newline, non-ASCII stays intact.
    assert load_chat_template("{{ messages[0]['content'] }}\\n é") == "{{ messages[0]['content'] }}\n é"
    with pytest.raises(ValueError, match="looks like a file path"):
        parse(["--chat-template", str(tmp_path / "missing.jinja")])
    with pytest.raises(ValueError, match="not a valid jinja2 template"):
        load_chat_template("{% for m in messages %}")
    loop = "{% for m in messages %}{{ m['content'] }}{% break %}{% endfor %}"  # transformers' loopcontrols
    assert load_chat_template(loop) == loop


def test_bad_chat_template_flag_is_a_usage_error(tmp_path):
    from pyengine.server.cli import main

    assert main(["--chat-template", str(tmp_path / "nope.jinja")]) == 2


# ---- /v1/models/{id}, /ping ----


def test_retrieve_model_by_id_slashes_and_aliases_included(client):
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model"
    assert client.models.retrieve("alias").id == "alias"
    assert [m.id for m in client.models.list().data] == [NAME, "alias"]


def test_retrieve_unknown_model_is_openai_404(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found"
    body = http.get("/v1/models/other/model").json()
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert body["error"]["type"] == "invalid_request_error"


def test_alias_is_accepted_by_requests(client):
    resp = client.completions.create(model="alias", prompt=[5, 6, 7], max_tokens=2,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2 and resp.model == NAME


def test_ping_is_health(synthetic):
    server, _ = synthetic
    health = httpx.get(f"{server.url}/health", timeout=10)  # no key needed, like /health
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{server.url}/ping", timeout=10)
        assert ping.status_code == 200 == health.status_code
        assert ping.json().keys() == health.json().keys()


# ---- /tokenize, /detokenize ----


def test_tokenize_prompt_as_vllm(synthetic, http):
    _, engine = synthetic
    body = http.post("/tokenize", json={"model": NAME, "prompt": "Hello world"}).json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == engine.tokenize("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert body["token_strs"] is None
    plain = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                         "return_token_strs": True}).json()
    assert plain["tokens"] == engine.tokenize("Hello world", add_special_tokens=False)
    assert plain["token_strs"] == [engine.tokenizer.id_to_token(t) for t in plain["tokens"]]


def test_tokenize_messages_renders_the_chat_template(synthetic, http):
    _, engine = synthetic
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    body = http.post("/tokenize", json={"messages": messages}).json()
    text = "[system] Be brief.\n[user] Hi \nthere\n[assistant]"  # text parts joined with newlines, as vLLM does
    assert body["tokens"] == engine.tokenize(text, add_special_tokens=False)
    no_prompt = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == engine.tokenize(text[:-len("[assistant]")], add_special_tokens=False)


def test_tokenize_needs_exactly_one_input(http):
    for payload in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
        resp = http.post("/tokenize", json=payload)
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = http.post("/tokenize", json={"prompt": "a", "model": "gpt-4"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_detokenize_round_trip_and_bad_ids(synthetic, http):
    _, engine = synthetic
    tokens = engine.tokenize("Hello world", add_special_tokens=False)
    assert http.post("/detokenize", json={"model": NAME, "tokens": tokens}).json() == {"prompt": "Hello world"}
    resp = http.post("/detokenize", json={"tokens": [1, engine.vocab_size + 5]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens"
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_tokenizer_endpoints_sit_behind_the_api_key(synthetic):
    server, _ = synthetic
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "a"}, timeout=10).status_code == 401
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [1]}, timeout=10).status_code == 401


# ---- text-only content ----


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_image_or_audio_parts_are_a_400_naming_the_field(client, http, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    error = info.value.body
    assert error["param"] == "messages[0].content[1].type" and error["code"] == "unsupported_content_type"
    assert "text only" in error["message"] and part["type"] in error["message"]
    resp = http.post("/tokenize", json={"messages": messages})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[0].content[1].type"


def test_text_part_without_text_is_a_400(http):
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[0].content[0].text"


def test_chat_with_text_parts_still_works(client):
    resp = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], max_tokens=3,
        extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.model == NAME


# ---- where the chat template comes from ----


def test_checkpoint_template_sources(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert checkpoint_chat_template(tmp_path, named).source == "D"
    assert checkpoint_chat_template(tmp_path, "C").origin == "tokenizer_config.json"
    assert checkpoint_chat_template(tmp_path, None) is None
    assert checkpoint_chat_template(None, None) is None
    (tmp_path / "chat_template.jinja").write_text("J")
    choice = checkpoint_chat_template(tmp_path, "C")  # the file wins, as transformers has it
    assert (choice.source, choice.origin) == ("J", "chat_template.jinja")


@pytest.fixture(scope="module")
def checkpoint_engine(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    engine = AsyncEngine(path, max_num_seqs=4, max_model_len=256, num_kv_blocks=64)
    yield path, engine
    engine.shutdown()


def tokenize_chat(server: LiveServer) -> list[int]:
    body = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                      timeout=10).json()
    return body["tokens"]


def test_template_from_tokenizer_config_then_jinja_file_then_flag(checkpoint_engine):
    path, engine = checkpoint_engine
    assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    special = engine.tokenizer.token_to_id("<|im_start|>")
    with LiveServer(engine, ServerArgs(stats_interval=0)) as server:
        assert server.context.chat_template_origin == "tokenizer_config.json"
        assert tokenize_chat(server)[0] == special  # the template's turn marker, one control token
    jinja = path / "chat_template.jinja"
    jinja.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    try:
        with LiveServer(engine, ServerArgs(stats_interval=0)) as server:
            assert server.context.chat_template_origin == "chat_template.jinja"
            assert tokenize_chat(server) == engine.tokenize("<<Hi>>", add_special_tokens=False)
        with LiveServer(engine, ServerArgs(stats_interval=0, chat_template=TEMPLATE)) as server:
            assert server.context.chat_template_origin == "--chat-template"
            assert tokenize_chat(server) == engine.tokenize("[user] Hi\n[assistant]", add_special_tokens=False)
    finally:
        jinja.unlink()
