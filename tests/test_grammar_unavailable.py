"""An engine whose grammar vocabulary cannot be built (an EOS id outside the vocabulary, a
tokenizer llguidance refuses) still starts and serves unconstrained requests; constrained
requests are refused with an ``InvalidRequestError`` saying why, never run unconstrained."""

from __future__ import annotations

import logging

import pytest

from pyengine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from pyengine.engine import grammar
from pyengine.engine.grammar import ConstraintCompiler
from pyengine.errors import InvalidConfigError
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.text.decode_table import DecodeTable

TABLE = DecodeTable(None, (b"a", b"b", b"</s>"), (b"a", b"b", b""), False)


def test_an_eos_id_outside_the_vocabulary_makes_constraints_unavailable(caplog):
    with caplog.at_level(logging.WARNING, logger="pyengine.engine.grammar"):
        compiler = ConstraintCompiler.for_engine(TABLE, [99], 3)
    assert compiler.native is None
    assert "token id 99 is outside the vocabulary" in compiler.unavailable
    assert sum("structured outputs are unavailable" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(InvalidRequestError, match="grammar vocabulary could not be built.*token id 99"):
        compiler.compile(StructuredOutputsParams(regex="a+"))
    assert ConstraintCompiler.for_engine(TABLE, [2], 3).native is not None  # the same table, a good EOS


def test_an_engine_whose_grammar_vocabulary_fails_starts_and_refuses_constraints(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise InvalidConfigError("invalid vocabulary: injected ParserFactory error")

    monkeypatch.setattr(grammar, "GrammarCompiler", refuse)
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=5)
    llm = LLM(str(checkpoint), max_num_seqs=4)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
        with pytest.raises(InvalidRequestError, match="structured_outputs cannot be enforced.*injected ParserFactory"):
            llm.generate([[5, 6, 7]], constrained, use_tqdm=False)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4  # the refusal harmed nothing
    finally:
        llm.shutdown()
