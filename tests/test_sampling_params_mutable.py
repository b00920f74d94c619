"""SamplingParams are mutable as vLLM's are (``sp.max_tokens = 16``); they are validated
when built and again when a request is added, so a field set to a bad value afterwards is
refused before queueing, naming the field. The engine keeps a copy of its own."""

from __future__ import annotations

import pytest

from pyengine import LLM, InvalidRequestError, PoolingParams, SamplingParams
from pyengine.sampling_params import sample_params


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_num_seqs=16)
    yield engine
    engine.shutdown()


def test_fields_can_be_set_after_construction(llm):
    sp = SamplingParams(temperature=0)
    sp.max_tokens = 3
    sp.ignore_eos = True
    out = llm.generate("hello", sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_construction_still_validates():
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        PoolingParams(pooling_type="max")  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("top_p", 5.0), ("temperature", -1.0), ("n", 0), ("seed", -1), ("top_k", -2),
    ("temperature", "hot"), ("stop", 5), ("stop", [""]), ("stop_token_ids", 7), ("stop_token_ids", [-1]),
    ("min_tokens", 100), ("logprobs", -1), ("n", True),
])
def test_a_bad_value_set_later_is_refused_when_added(llm, field, value):
    sp = SamplingParams(max_tokens=4)
    setattr(sp, field, value)
    with pytest.raises(InvalidRequestError, match=f"^{field}"):
        llm.generate("hello", sp, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=f"^{field}"):
        llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False)
    assert llm.stats().num_waiting == 0 and llm.stats().num_running == 0  # nothing was queued


def test_a_bad_pooling_value_set_later_is_refused(llm):
    pp = PoolingParams()
    pp.pooling_type = "max"  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        llm.embed("hello", pp, use_tqdm=False)


def test_the_engine_keeps_its_own_copy():
    sp = SamplingParams(stop=["a"], stop_token_ids=[3])
    taken = sp.checked()
    sp.max_tokens, sp.temperature = 1, 0.0
    sp.stop.append("b")  # type: ignore[union-attr]
    sp.stop_token_ids.append(4)  # type: ignore[union-attr]
    assert (taken.max_tokens, taken.temperature, taken.stop, taken.stop_token_ids) == (16, 1.0, ["a"], [3])
    assert taken is not sp and taken == SamplingParams(stop=["a"], stop_token_ids=[3])


def test_seeded_samples_still_get_their_own_seeds(llm):
    sp = SamplingParams(n=3, seed=7, max_tokens=4)
    assert [p.seed for p in (sample_params(sp, i) for i in range(3))] == [7, 8, 9]
    assert sp.seed == 7 and sp.n == 3  # the caller's object is untouched
    sp.temperature = 1.0
    out = llm.generate("hello", sp, use_tqdm=False)
    again = llm.generate("hello", sp, use_tqdm=False)
    assert [c.token_ids for c in out[0].outputs] == [c.token_ids for c in again[0].outputs]


def test_one_params_object_shared_by_a_batch_and_changed_between_batches(llm):
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate(["a", "b", "c"], sp, use_tqdm=False)
    sp.max_tokens = 5
    second = llm.generate(["a", "b", "c"], sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in first] == [2, 2, 2]
    assert [len(o.outputs[0].token_ids) for o in second] == [5, 5, 5]
    assert [o.outputs[0].token_ids[:2] for o in second] == [o.outputs[0].token_ids for o in first]
