"""N-gram speculation through the whole engine (scheduler thread, executor loop, output
thread) with an executor double that verifies drafts greedily (``GreedySpecRunner``):
the outputs equal those without speculation, token for token and with their
log-probabilities, under preemption (a small KV pool), n > 1, stop strings found among
several tokens of one step and streamed deltas. The model runner's own verification is
tested by its own suite."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pyengine import LLM, AsyncEngine, SamplingParams
from pyengine._sched import SchedulerConfig
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.testing.spec_runner import GreedySpecRunner


@dataclasses.dataclass(frozen=True)
class _SpecConfig(EngineConfig):
    """EngineConfig with the scheduler's speculation on (the engine's own
    ``speculative_config`` is the executor side's; this drives the scheduler directly)."""

    def scheduler_config(self, num_blocks: int, block_size: int, max_model_len: int,
                         kv_groups=(), group_tables: bool = False) -> SchedulerConfig:
        c = super().scheduler_config(num_blocks, block_size, max_model_len, kv_groups, group_tables)
        return SchedulerConfig(
            c.num_blocks, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            enable_prefix_caching=c.enable_prefix_caching, policy=c.policy, pipeline_depth=c.pipeline_depth,
            num_speculative_tokens=3, speculative_method="ngram", spec_min_acceptance=0.0)


def _engine(spec: bool, num_blocks: int = 4096) -> tuple[LLM, GreedySpecRunner]:
    runner = GreedySpecRunner(vocab=40, num_kv_blocks=num_blocks, max_rows=64)
    cls = _SpecConfig if spec else EngineConfig
    return LLM.from_engine_core(EngineCore(cls(max_num_seqs=8, max_num_batched_tokens=64), runner=runner)), runner


PROMPTS = [[(3 * i + j) % 40 for j in range(5 + i)] for i in range(8)]


def _run(llm: LLM, params: SamplingParams):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], c.finish_reason)
             for c in o.outputs] for o in outs]


@pytest.mark.parametrize("num_blocks", [4096, 24])
def test_greedy_outputs_and_logprobs_equal_speculation_off(num_blocks):
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1, n=2)
    plain, _ = _engine(False, num_blocks)
    spec, runner = _engine(True, num_blocks)
    try:
        want = _run(plain, params)
        got = _run(spec, params)
        assert got == want
        stats = spec.engine_core.stats().scheduler
        assert stats["spec_accepted_tokens"] > 0 and runner.drafted_steps > 0
        assert stats["kv_blocks_used"] == 0
        # (Whether the small pool preempts depends on how the requests' arrival interleaves
        # with the first steps; preemption with drafts is covered deterministically by
        # rust_sched/sched/tests/spec_model.rs.)
        # Each token's log-probability is its own row's (-token / 1000), not another entry's.
        for per_prompt in got:
            for tokens, logprobs, _ in per_prompt:
                assert logprobs == pytest.approx([-t / 1000 for t in tokens])
    finally:
        plain.shutdown()
        spec.shutdown()


def test_stop_strings_found_among_a_steps_tokens_and_streamed_deltas():
    plain, _ = _engine(False)
    spec, _ = _engine(True)
    try:
        reference = plain.generate([PROMPTS[2]], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
        text = reference[0].outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        assert stop.strip(), "the reference text has something to stop at"
        params = SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])
        want = plain.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)
        assert list(got.token_ids) == list(want.token_ids)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_streamed_deltas_add_up_with_several_tokens_per_step():
    runner = GreedySpecRunner(vocab=40, max_rows=64)
    core = EngineCore(_SpecConfig(max_num_seqs=4), runner=runner)
    engine = AsyncEngine.from_engine_core(core)

    async def stream():
        deltas = []
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        async for out in engine.generate(PROMPTS[1], params, "s", output_kind="delta"):
            deltas.append(out.outputs[0])
        return deltas

    plain, _ = _engine(False)
    try:
        deltas = asyncio.run(stream())
        tokens = [t for d in deltas for t in d.token_ids]
        assert any(len(d.token_ids) > 1 for d in deltas), "some steps accepted drafts"
        want = plain.generate([PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
        assert tokens == list(want[0].outputs[0].token_ids)
        assert "".join(d.text for d in deltas) == want[0].outputs[0].text
        assert deltas[-1].finish_reason == "length"
    finally:
        engine.shutdown()
        plain.shutdown()
