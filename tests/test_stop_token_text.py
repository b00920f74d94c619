"""The token that ends a sequence (EOS or one of ``stop_token_ids``) stays in its token ids
but not in its text, as in vLLM: with ``skip_special_tokens=False`` (which tool-call
parsing uses) an answer must not end in ``<|eos|>``. ``include_stop_str_in_output`` keeps
it. Checked on whole outputs (``LLM.generate``) and on streamed deltas (``AsyncEngine``),
with a scripted executor whose tokens are known."""

from __future__ import annotations

import asyncio

import pytest

from pyengine import LLM, AsyncEngine, SamplingParams
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.models.default_tokenizer import EOS_TOKEN, IM_END_TOKEN
from pyengine.testing.synthetic_runner import ScriptedRunner

TEXT = "Hello, world!"


def scripted(end_token: str):
    runner = ScriptedRunner([0], eos_token_ids=())  # the script is set below, from the tokenizer
    tok = runner.loaded.tokenizer
    eos = tok.token_to_id(EOS_TOKEN)
    runner.script = tok.encode(TEXT, add_special_tokens=False).ids + [tok.token_to_id(end_token)]
    runner.loaded = type(runner.loaded)(tok, (eos,))
    return runner, tok


@pytest.fixture(scope="module")
def llm():
    runner, tok = scripted(EOS_TOKEN)
    engine = LLM.from_engine_core(EngineCore(EngineConfig(max_num_seqs=4), runner=runner))
    yield engine, tok
    engine.shutdown()


@pytest.mark.parametrize("skip", [True, False])
def test_eos_is_in_the_ids_not_the_text(llm, skip):
    engine, tok = llm
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=50, skip_special_tokens=skip), use_tqdm=False)[0]
    sample = out.outputs[0]
    assert sample.finish_reason == "stop"
    assert sample.token_ids[-1] == tok.token_to_id(EOS_TOKEN)
    assert sample.text == TEXT


def test_include_stop_str_in_output_keeps_the_stop_tokens_text(llm):
    engine, _ = llm
    params = SamplingParams(max_tokens=50, skip_special_tokens=False, include_stop_str_in_output=True)
    assert engine.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].text == TEXT + EOS_TOKEN


def test_a_stop_token_id_is_left_out_of_the_text_too(llm):
    engine, tok = llm
    comma = tok.encode(",", add_special_tokens=False).ids[0]
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=50, stop_token_ids=[comma]), use_tqdm=False)[0]
    assert out.outputs[0].text == "Hello" and out.outputs[0].token_ids[-1] == comma


def test_streamed_deltas_leave_it_out():
    runner, tok = scripted(IM_END_TOKEN)  # a special token that is not EOS: a stop token id
    engine = AsyncEngine.from_engine_core(EngineCore(EngineConfig(max_num_seqs=4), runner=runner))

    async def stream(params):
        pieces = []
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, output_kind="delta"):
            pieces.append(out.outputs[0].text)
        return pieces

    try:
        stop_id = tok.token_to_id(IM_END_TOKEN)
        pieces = asyncio.run(stream(SamplingParams(max_tokens=50, skip_special_tokens=False,
                                                   stop_token_ids=[stop_id])))
        assert "".join(pieces) == TEXT and len(pieces) > 2
        kept = asyncio.run(stream(SamplingParams(max_tokens=50, skip_special_tokens=False, stop_token_ids=[stop_id],
                                                 include_stop_str_in_output=True)))
        assert "".join(kept) == TEXT + IM_END_TOKEN
    finally:
        engine.shutdown()
