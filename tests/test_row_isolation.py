"""One request's bad row fails that request only: the others in the same step finish
with exactly the tokens they get without it. Bad sampling values never reach a step."""

from __future__ import annotations

import pytest

from pyengine import LLM, EngineError, InvalidRequestError, SamplingParams
from pyengine.executor.sampler import Sampler
from pyengine.executor.sampling_table import SamplingTable
from pyengine.testing.faults import FaultySink

GUILTY_TEMPERATURE = 0.123  # marks the request whose row is made to fail
PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(8)]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_num_seqs=16, max_num_batched_tokens=512)
    yield engine
    engine.shutdown()


def healthy_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run_together(llm, guilty: bool):
    """The 8 healthy requests, plus (when ``guilty``) one marked request, all in flight at once."""
    core = llm.engine_core
    sinks = {}
    for i, prompt in enumerate(PROMPTS):
        sinks[f"ok-{i}"] = FaultySink(fail_on=0)
        core.add_request(f"ok-{i}", None, prompt, healthy_params(), sinks[f"ok-{i}"])
    if guilty:
        sinks["guilty"] = FaultySink(fail_on=0)
        params = SamplingParams(temperature=GUILTY_TEMPERATURE, max_tokens=12, ignore_eos=True, seed=1)
        core.add_request("guilty", None, [9, 9, 9], params, sinks["guilty"])
    for sink in sinks.values():
        assert sink.done.wait(60), "a caller was left waiting"
    return sinks


def tokens(sink):
    assert sink.error is None, sink.error
    return sink.outputs[-1].outputs[0].token_ids


def test_a_row_whose_sampling_fails_fails_only_its_request(llm, monkeypatch):
    reference = {rid: tokens(s) for rid, s in run_together(llm, guilty=False).items()}
    sample = Sampler.sample

    def fail_on_the_marked_row(self, logits, rows, next_positions, history):
        temperatures = self.table.values["temperature"][rows.astype("int64")]
        if bool((abs(temperatures - GUILTY_TEMPERATURE) < 1e-6).any()):
            raise RuntimeError("injected fault in one row")
        return sample(self, logits, rows, next_positions, history)

    monkeypatch.setattr(Sampler, "sample", fail_on_the_marked_row)
    sinks = run_together(llm, guilty=True)
    assert isinstance(sinks["guilty"].error, EngineError)
    assert "injected fault in one row" in str(sinks["guilty"].error)
    assert {rid: tokens(s) for rid, s in sinks.items() if rid != "guilty"} == reference
    monkeypatch.undo()
    assert tokens(run_together(llm, guilty=True)["guilty"])  # the engine serves it again once fixed


def test_a_row_whose_parameters_cannot_be_installed_fails_only_its_request(llm, monkeypatch):
    reference = {rid: tokens(s) for rid, s in run_together(llm, guilty=False).items()}
    install = SamplingTable.install

    def refuse_the_marked_params(self, rows, params):
        if any(abs(p.temperature - GUILTY_TEMPERATURE) < 1e-6 for p in params):
            raise OverflowError("injected fault in one row's parameters")
        return install(self, rows, params)

    monkeypatch.setattr(SamplingTable, "install", refuse_the_marked_params)
    sinks = run_together(llm, guilty=True)
    assert "injected fault in one row's parameters" in str(sinks["guilty"].error)
    assert {rid: tokens(s) for rid, s in sinks.items() if rid != "guilty"} == reference


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_k=2**63), "top_k"),
    (dict(seed=2**64), "seed"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"),
    (dict(stop_token_ids=[1] * 1025), "stop_token_ids"),
    (dict(stop=["x"] * 129), "stop"),
    (dict(stop=["x" * 1025]), "stop"),
])
def test_values_out_of_range_are_refused_when_the_params_are_built(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_stop_token_ids_outside_the_vocabulary_are_refused_before_queueing(llm):
    params = SamplingParams(stop_token_ids=[1_000_000], min_tokens=1, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="stop_token_ids holds 1000000, outside the vocabulary"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert llm.stats().queue_depths["requests"] == 0
