"""vLLM's offline surface beyond ``generate``: ``LLM.chat`` (prompt tokens identical to
transformers' ``apply_chat_template`` on the same checkpoint), ``get_tokenizer`` (a
transformers tokenizer), ``get_default_sampling_params`` and ``encode``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerFast

from pyengine import LLM, InvalidRequestError, SamplingParams
from pyengine.inputs.chat_template import ChatTemplateError
from pyengine.testing.checkpoints import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello, world! 你好"},
]
# A template that shows what it was given: tools, kwargs and the special tokens.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools is not none %}[tools]{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if flavour is defined %}({{ flavour }}){% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <b> café",
                                            "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(checkpoint, max_num_seqs=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' own tokenizer for the checkpoint (not ours)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


def hf_ids(tokenizer, conversation, **kwargs):
    return list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs))


def test_the_tiny_checkpoint_carries_a_chat_template(checkpoint):
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert "im_start" in config["chat_template"]


def test_chat_prompt_tokens_match_transformers(llm, reference):
    out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert len(out) == 1
    assert out[0].prompt_token_ids == hf_ids(reference, CONVERSATION, add_generation_prompt=True)
    assert out[0].prompt == reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert len(out[0].outputs[0].token_ids) == 4


def test_chat_without_the_generation_prompt_matches_transformers(llm, reference):
    out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert out[0].prompt_token_ids == hf_ids(reference, CONVERSATION, add_generation_prompt=False)


def test_continue_final_message_matches_transformers(llm, reference):
    conversation = [*CONVERSATION, {"role": "assistant", "content": "The answer is"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    expected = hf_ids(reference, conversation, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt_token_ids == expected
    assert out[0].prompt.endswith("The answer is")
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        llm.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True)


def test_tools_kwargs_and_a_given_template_match_transformers(llm, reference):
    out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=TOOLS,
                   chat_template_kwargs={"flavour": "mint"})
    expected = reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True,
                                             chat_template=TOOLS_TEMPLATE, tools=TOOLS, flavour="mint")
    assert out[0].prompt == expected and "get_weather" in expected and "(mint)" in expected
    assert out[0].prompt_token_ids == hf_ids(reference, CONVERSATION, add_generation_prompt=True,
                                             chat_template=TOOLS_TEMPLATE, tools=TOOLS, flavour="mint")
    # Without tools the template sees tools = None, as under transformers.
    plain = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE)
    assert "[tools]" not in plain[0].prompt


def test_a_template_file_is_read(llm, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TOOLS_TEMPLATE)
    out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=str(path))
    assert out[0].prompt.endswith("<|im_start|>assistant\n") and "{{" not in out[0].prompt


def test_a_list_of_conversations_comes_back_in_order(llm, reference):
    conversations = [[{"role": "user", "content": f"question {i}" * (i + 1)}] for i in range(5)]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [hf_ids(reference, c, add_generation_prompt=True)
                                                  for c in conversations]
    # The same prompts through generate give the same greedy tokens.
    again = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    per_conversation = [SamplingParams(temperature=0, max_tokens=k + 1, ignore_eos=True) for k in range(5)]
    outs = llm.chat(conversations, per_conversation, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]


def test_text_parts_are_joined_and_other_parts_refused(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    joined = [{"role": "user", "content": "one\ntwo"}]
    assert llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt_token_ids == \
        llm.chat(joined, GREEDY, use_tqdm=False)[0].prompt_token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[0\].*text only"):
        llm.chat(image, GREEDY, use_tqdm=False)


def test_bad_input_is_an_invalid_request(llm):
    with pytest.raises(InvalidRequestError, match="messages"):
        llm.chat("hello", GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\[0\]"):
        llm.chat([CONVERSATION, [{"content": "no role"}]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(ChatTemplateError, match="nope"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template="{{ raise_exception('nope') }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template="{% for %}")
    assert llm.chat(CONVERSATION, GREEDY, use_tqdm=False)[0].finished  # still serving


def test_get_tokenizer_is_a_transformers_tokenizer(llm, checkpoint):
    tok = llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast) and llm.get_tokenizer() is tok
    text = "Hello, world! 你好 😀"
    ids = tok.encode(text, add_special_tokens=False)
    assert isinstance(ids, list) and ids == llm.engine_core.tokenize(text)
    assert tok.decode(ids) == text
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert tok.eos_token == config["eos_token"] and tok.eos_token_id == tok.convert_tokens_to_ids(config["eos_token"])
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered == llm.chat(CONVERSATION, GREEDY, use_tqdm=False)[0].prompt


def test_a_checkpoint_without_a_template_in_its_config(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    with LLM(folder, max_num_seqs=4) as llm:
        with pytest.raises(InvalidRequestError, match="no chat template"):
            llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
        given = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=template)
        assert given[0].prompt.startswith("<|im_start|>system")
    # chat_template.jinja, as current transformers writes it, is read too.
    (folder / "chat_template.jinja").write_text(template)
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder))
    with LLM(folder, max_num_seqs=4) as llm:
        out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
        assert out[0].prompt_token_ids == hf_ids(reference, CONVERSATION, add_generation_prompt=True)
        assert llm.get_tokenizer().chat_template == template


def test_encode_is_embed(llm):
    a = llm.encode(["hello", "world"], use_tqdm=False)
    b = llm.embed(["hello", "world"], use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        # Whether the two prompts share a step depends on when the second one reaches the
        # scheduler, and a prompt prefilled alone differs from one prefilled beside another
        # in float32's last bits (7e-8 here): the same task, not bit-identical floats.
        assert x.prompt_token_ids == y.prompt_token_ids
        assert x.outputs.embedding == pytest.approx(y.outputs.embedding, rel=1e-4, abs=1e-6)
    with pytest.raises(InvalidRequestError, match="pooling_task"):
        llm.encode("hello", use_tqdm=False, pooling_task="classify")


def test_default_sampling_params_are_plain_without_generation_defaults(llm):
    # The tiny checkpoint's generation_config.json has no sampling defaults: vLLM's plain SamplingParams().
    first = llm.get_default_sampling_params()
    assert first == SamplingParams() and first is not llm.get_default_sampling_params()
    first.max_tokens = 2  # a fresh object each call: changing one changes nothing else
    assert llm.get_default_sampling_params().max_tokens == 16
    out = llm.generate("hello", use_tqdm=False)  # None: the defaults
    assert out[0].outputs[0].finish_reason in ("stop", "length") and len(out[0].outputs[0].token_ids) <= 16


def test_generation_config_defaults_become_sampling_params_fields():
    from pyengine.engine.checkpoint_extras import sampling_defaults
    from pyengine.models.loader import generation_defaults

    generation = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "eos_token_id": 1,
                  "min_p": None}
    loaded = SimpleNamespace(generation_config=generation_defaults(generation))
    fields = sampling_defaults(SimpleNamespace(generation_config="auto"), loaded)
    assert SamplingParams(**fields) == SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=64)
    assert sampling_defaults(SimpleNamespace(generation_config="vllm"), loaded) == {}  # vLLM's "ignore them"
    assert sampling_defaults(SimpleNamespace(generation_config="auto"), SimpleNamespace()) == {}  # synthetic


# A template that writes an assistant turn's tool calls and a tool turn's call id.
CALLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}{{ m['content'] or '' }}"
    "{% if m.tool_call_id is defined %} ({{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL_HISTORY = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_tool_turns_reach_the_template_with_their_arguments_parsed(llm, reference):
    out = llm.chat(CALL_HISTORY, GREEDY, use_tqdm=False, chat_template=CALLS_TEMPLATE, tools=TOOLS)
    # transformers gets the arguments as a dict (what templates expect, and vLLM passes).
    expected = json.loads(json.dumps(CALL_HISTORY))
    expected[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert out[0].prompt_token_ids == hf_ids(reference, expected, chat_template=CALLS_TEMPLATE, tools=TOOLS,
                                             add_generation_prompt=True)
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in out[0].prompt
    assert "(call_1)" in out[0].prompt


def test_tool_calls_with_arguments_that_are_not_json_are_refused(llm):
    bad = json.loads(json.dumps(CALL_HISTORY))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{city"
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        llm.chat(bad, GREEDY, use_tqdm=False, chat_template=CALLS_TEMPLATE)
    bad[1]["tool_calls"] = [{"type": "function"}]
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.tool_calls\[0\]"):
        llm.chat(bad, GREEDY, use_tqdm=False, chat_template=CALLS_TEMPLATE)
