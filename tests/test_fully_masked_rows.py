"""A request whose restrictions leave a step no token to sample: refused at add time when
its own fields say so, else failed alone (with a clear error) by the executor, never
served a garbage token; the other requests of the step are unaffected."""

from __future__ import annotations

import pytest

from pyengine import (
    LLM,
    EngineError,
    InvalidRequestError,
    LogitsProcessor,
    SamplingParams,
    StructuredOutputsParams,
)
from pyengine.logits_processors.index_state import update_entries
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import FaultySink

NEIGHBOUR = [5, 60, 7, 300]


class MaskAllLogitsProcessor(LogitsProcessor):
    """Sets every logit of the requests with extra_args={"mask_all": True} to -inf."""

    def __init__(self, config, device, is_pin_memory):
        self.masked: dict[int, bool] = {}  # batch index -> True, for the requests that asked

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        update_entries(self.masked, batch_update, lambda params, *_: (params.extra_args or {}).get("mask_all") or None)

    def apply(self, logits):
        for index in self.masked:
            if index < logits.shape[0]:
                logits[index] = float("-inf")
        return logits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("masked") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(str(checkpoint), max_num_seqs=8, max_num_batched_tokens=64)
    yield engine
    engine.shutdown()


def params(temperature: float, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=1, max_tokens=6, ignore_eos=True, **kwargs)


def run_beside_a_neighbour(llm, prompt, restricted: SamplingParams):
    """Runs ``restricted`` with an unrestricted request in the same steps; returns the
    restricted request's sink and the neighbour's tokens (and its tokens alone)."""
    neighbour = params(1.0)
    alone = llm.generate([NEIGHBOUR], neighbour, use_tqdm=False)[0].outputs[0].token_ids
    sinks = {"restricted": FaultySink(fail_on=0), "neighbour": FaultySink(fail_on=0)}
    llm.engine_core.add_request("neighbour", None, NEIGHBOUR, neighbour, sinks["neighbour"])
    llm.engine_core.add_request("restricted", None, prompt, restricted, sinks["restricted"])
    for sink in sinks.values():
        assert sink.done.wait(60), "a caller was left waiting"
    assert sinks["neighbour"].error is None
    assert sinks["neighbour"].outputs[-1].outputs[0].token_ids == alone
    return sinks["restricted"]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_allowed_end_tokens_under_min_tokens_are_refused(llm, ignore_eos):
    eos = llm.engine_core.eos_token_ids
    stop = [] if not ignore_eos else [11]
    allowed = list(eos) if not ignore_eos else [11]
    with pytest.raises(InvalidRequestError, match="allowed_token_ids holds only end tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=ignore_eos,
                                              stop_token_ids=stop, allowed_token_ids=allowed), use_tqdm=False)
    # Without the minimum, or with another allowed token, the same request is served.
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=ignore_eos,
                                                stop_token_ids=stop, allowed_token_ids=allowed + [9]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:2] == [9, 9]


def test_allowed_tokens_that_are_all_bad_words_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="every token of allowed_token_ids is also a bad word"):
        llm.generate([[1, 2]], params(0.0, allowed_token_ids=[9, 10], _bad_words_token_ids=[[9], [10]]),
                     use_tqdm=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_longer_bad_word_that_exhausts_allowed_tokens_fails_only_its_request(llm, temperature):
    # Token 9 is the only one allowed; once sampled, the bad word (9, 9) forbids it.
    sink = run_beside_a_neighbour(
        llm, [1, 2, 3], params(temperature, allowed_token_ids=[9], _bad_words_token_ids=[[9, 9]])
    )
    assert isinstance(sink.error, EngineError)
    assert "no token can be sampled" in str(sink.error)
    assert all(token == 9 for o in sink.outputs for c in o.outputs for token in c.token_ids)
    assert llm.engine_core.is_alive


def test_a_grammar_and_allowed_tokens_with_nothing_in_common_fail_only_their_request(llm):
    tokenizer = llm.engine_core.tokenizer
    outside = tokenizer.encode("x", add_special_tokens=False).ids[0]
    restricted = params(1.0, allowed_token_ids=[outside], structured_outputs=StructuredOutputsParams(choice=["hello"]))
    sink = run_beside_a_neighbour(llm, [1, 2, 3], restricted)
    assert isinstance(sink.error, EngineError)
    assert "no token can be sampled" in str(sink.error)
    assert not [t for o in sink.outputs for c in o.outputs for t in c.token_ids]


def test_a_custom_processor_that_masks_everything_fails_only_its_request(checkpoint):
    engine = LLM(str(checkpoint), max_num_seqs=8, max_num_batched_tokens=64,
                 logits_processors=[MaskAllLogitsProcessor])
    try:
        for temperature in (0.0, 1.0):
            sink = run_beside_a_neighbour(engine, [1, 2, 3], params(temperature, extra_args={"mask_all": True}))
            assert isinstance(sink.error, EngineError)
            assert "no token can be sampled" in str(sink.error)
        assert engine.engine_core.is_alive
    finally:
        engine.shutdown()
