"""A step whose grammar mask fails (a scheduler stall past the mask timeout, a dropped
mask) fails its constrained requests only: the unconstrained requests in the same steps
finish with exactly the tokens they get without the fault, and the engine serves
constrained requests again once the masks come."""

from __future__ import annotations

import pytest

from pyengine import LLM, EngineError, SamplingParams, StructuredOutputsParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import FaultySink, install_faulty_runner
from pyengine.testing.waits import wait_until

PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(6)]
CHOICE = StructuredOutputsParams(regex="[ab]{3,40}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("mask_faults") / "qwen3", "qwen3", seed=5)
    engine = LLM(str(checkpoint), max_num_seqs=16, max_num_batched_tokens=512)
    yield engine
    engine.shutdown()


def run_together(llm, constrained: int):
    """The unconstrained requests and ``constrained`` constrained ones, all in flight at once."""
    core = llm.engine_core
    sinks = {}
    for i, prompt in enumerate(PROMPTS):
        sinks[f"free-{i}"] = FaultySink(fail_on=0)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        core.add_request(f"free-{i}", None, prompt, params, sinks[f"free-{i}"])
    for i in range(constrained):
        sinks[f"regex-{i}"] = FaultySink(fail_on=0)
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_outputs=CHOICE)
        core.add_request(f"regex-{i}", None, [9, 9, 9 + i], params, sinks[f"regex-{i}"])
    for sink in sinks.values():
        assert sink.done.wait(60), "a caller was left waiting"
    return sinks


def completion(sink):
    assert sink.error is None, sink.error
    return sink.outputs[-1].outputs[0]


def test_a_failed_mask_fails_only_the_constrained_requests(llm):
    reference = {rid: completion(s).token_ids for rid, s in run_together(llm, constrained=0).items()}
    faulty = install_faulty_runner(llm.engine_core)
    faulty.fail_masks.set()
    try:
        sinks = run_together(llm, constrained=3)
    finally:
        faulty.fail_masks.clear()
    assert_idle(llm.engine_core)
    for i in range(3):
        error = sinks[f"regex-{i}"].error
        assert isinstance(error, EngineError), error
        assert "grammar mask" in str(error) and "did not arrive" in str(error)
    assert {rid: completion(s).token_ids for rid, s in sinks.items() if rid.startswith("free")} == reference
    # Nothing was left behind: the constrained requests are served (and masked) again.
    sinks = run_together(llm, constrained=3)
    for i in range(3):
        out = completion(sinks[f"regex-{i}"])
        assert out.finish_reason in ("stop", "length")
        assert set(out.text) <= {"a", "b"}, out.text
    assert {rid: completion(s).token_ids for rid, s in sinks.items() if rid.startswith("free")} == reference
    assert_idle(llm.engine_core)


def assert_idle(core):
    """Every KV block back in the pool and nothing running (the failed requests released theirs)."""
    wait_until(lambda: core.stats().kv_usage == 0, 5, interval=0.01)
    stats = core.stats()
    assert stats.kv_usage == 0 and stats.num_running == 0 and stats.num_waiting == 0
