"""A failed step with constrained rows (the executor could not run it) leaves the
scheduler consistent: its sequences end with "error", the step planned after it still
gets its mask (rows of ended sequences allow everything), every KV block returns, and the next
constrained request follows its grammar from a fresh matcher. Then the same through the
whole engine with an injected executor failure."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import (
    FINISH_REASONS,
    LLM,
    EngineError,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StructuredOutputsParams,
)
from pyengine._sched import GrammarCompiler
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import FaultySink, install_faulty_runner
from pyengine.testing.waits import wait_engine_idle

TOKENS = [b"a", b"b", b"c", b"ab", b"<eos>"]
EOS = 4


def allowed(bits: np.ndarray, row: int) -> list[int]:
    return [t for t in range(bits.shape[1] * 32) if bits[row, t // 32] >> np.uint32(t % 32) & 1]


def test_fail_step_with_constrained_rows_at_depth_2():
    compiler = GrammarCompiler(TOKENS, [], [EOS], 40)
    s = Scheduler(SchedulerConfig(16, block_size=4, max_model_len=64, pipeline_depth=2))
    s.add_request(Request("c", [0, 1, 2], max_tokens=8, constraint=compiler.compile("regex", "ab?c")))
    s.add_request(Request("u", [0, 1], max_tokens=8))
    first, second = s.schedule(), s.schedule()
    assert first.grammar_mask is not None and second.grammar_mask is not None
    first.grammar_mask.take(1.0)
    s.fail_step(first.step_id)
    ended = s.take_output(first.step_id)
    assert sorted(FINISH_REASONS[r] for r in ended.finish_reasons) == ["error", "error"]
    bits, _ = second.grammar_mask.take(1.0)  # the next step's mask comes: ended rows allow all
    assert bits.shape[0] == len(second.mask_sample_indices) and (bits == 0xFFFFFFFF).all()
    s.apply_result(second.step_id, np.zeros(len(second.logits_indices), dtype=np.int64))
    s.take_output(second.step_id)
    stats = s.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_inflight_steps"] == 0
    assert stats["generated_tokens"] == 0  # the extra tokens of ended sequences were dropped
    # A new constrained request starts from its grammar's beginning.
    s.add_request(Request("again", [0], max_tokens=8, constraint=compiler.compile("regex", "ab?c")))
    tokens, reasons = [], []
    while s.has_unfinished():
        plan = s.schedule()
        options = allowed(plan.grammar_mask.take(1.0)[0], 0)
        s.apply_result(plan.step_id, np.array([options[-1]], dtype=np.int64))
        ev = s.take_output(plan.step_id)
        tokens += ev.token_ids.tolist()
        reasons += [FINISH_REASONS[r] for r in ev.finish_reasons]
    assert tokens == [3, 2] and reasons == ["stop"]
    assert s.stats()["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("fail_step") / "qwen3", "qwen3", seed=5)
    engine = LLM(str(checkpoint), max_num_seqs=8)
    yield engine
    engine.shutdown()


def test_a_failed_step_with_constrained_rows_through_the_engine(llm):
    core = llm.engine_core
    regex = StructuredOutputsParams(regex="[ab]{4,30}")
    faulty = install_faulty_runner(core)
    faulty.fail_after(3)  # mid-generation: the matchers have advanced
    sinks = {}
    for i in range(3):
        sinks[i] = FaultySink(fail_on=0)
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True, structured_outputs=regex)
        core.add_request(f"r{i}", None, [5, 6, 7 + i], params, sinks[i])
    for sink in sinks.values():
        assert sink.done.wait(60)
    failed = [i for i, s in sinks.items() if isinstance(s.error, EngineError)]
    assert failed, [s.outputs[-1].outputs[0].finish_reason for s in sinks.values()]  # the failed step's requests
    for i, sink in sinks.items():
        if i not in failed:  # finished before the failed step: by their grammar
            out = sink.outputs[-1].outputs[0]
            assert out.finish_reason in ("stop", "length") and set(out.text) <= {"a", "b"}
    assert wait_engine_idle(core, 5), core.stats()
    outs = llm.generate([[5, 6, 7]] * 3, SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=20,
                                                        structured_outputs=regex), use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason in ("stop", "length") and set(c.text) <= {"a", "b"}, (c.finish_reason, c.text)
        if c.finish_reason == "stop":
            assert 4 <= len(c.text) <= 30
