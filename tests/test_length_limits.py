"""Prompt plus ``max_tokens`` over ``max_model_len``, as vLLM handles it: offline the request
is generated up to the limit and ends with "length"; the server answers 400 in vLLM's
words (clients parse them); a prompt alone over the limit is refused by both."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pyengine import LLM, SamplingParams
from pyengine.errors import InvalidRequestError
from pyengine.server.errors import APIError
from pyengine.server.sampling import check_length


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=32, num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=64) as llm:
        yield llm


def test_offline_a_request_past_the_limit_is_generated_up_to_it(llm):
    prompt = {"prompt_token_ids": list(range(5, 25))}  # 20 tokens: 12 left of 32
    out = llm.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (12, "length")
    within = llm.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (len(within.token_ids), within.finish_reason) == (5, "length")


def test_offline_a_prompt_alone_over_the_limit_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate({"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.generate("ok", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids  # still usable


def test_the_server_answers_in_vllms_words():
    ctx = SimpleNamespace(max_model_len=4096)
    with pytest.raises(APIError) as too_long:
        check_length(ctx, 1297, 4000, "messages", "max_tokens")
    assert str(too_long.value.message) == (
        "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's maximum context length is "
        "4096 tokens and your request has 1297 input tokens (4000 > 4096 - 1297).")
    assert (too_long.value.status, too_long.value.param, too_long.value.code) == (400, "max_tokens",
                                                                                  "context_length_exceeded")
    with pytest.raises(APIError) as prompt_alone:
        check_length(ctx, 5000, None, "prompt")
    assert prompt_alone.value.message == ("This model's maximum context length is 4096 tokens. However, your "
                                          "request has 5000 input tokens. Please reduce the length of the input "
                                          "messages.")
    check_length(ctx, 96, 4000, "prompt")  # exactly the limit: fine
