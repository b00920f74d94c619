"""ModelRunner behaviour beyond model parity: KV sizing, rows, pooling, seeds, penalties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.executor.persistent_batch import PlanStateError
from pyengine.sampling_params import PoolingParams, SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner

VOCAB = 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _runner(path, **overrides) -> ModelRunner:
    settings = dict(max_num_seqs=8, max_model_len=256, num_kv_blocks=128)
    settings.update(overrides)
    return ModelRunner.from_pretrained(path, ExecutorConfig(**settings))


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def _generate(runner, planner, steps, chunk=None):
    for _ in range(steps):
        plan = planner.next_plan(max_chunk=chunk)
        planner.record(plan, runner.execute(plan).sampled_token_ids)


def test_kv_blocks_come_from_the_byte_budget(checkpoint):
    runner = _runner(checkpoint, num_kv_blocks=None, kv_cache_bytes=1 << 20)
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # k+v, layers, block, kv heads, head_dim, float32
    assert runner.kv_shape.bytes_per_block == per_block
    assert runner.num_kv_blocks == (1 << 20) // per_block
    assert runner.kv_cache.keys.shape == (2, runner.num_kv_blocks, 16, 2, 16)
    capped = _runner(checkpoint, num_kv_blocks=None, kv_cache_bytes=1 << 30)
    assert capped.num_kv_blocks == 8 * 16  # never more than every row at max_model_len
    with pytest.raises(ValueError, match="holds no block"):
        _runner(checkpoint, num_kv_blocks=None, kv_cache_bytes=100)


def test_reused_rows_start_clean(checkpoint):
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5)
    alone = HandPlanner(num_blocks=128, max_rows=2)
    runner = _runner(checkpoint)
    second_alone = alone.add(_prompt(2, 20), penalised)
    _generate(runner, alone, 12)
    shared = HandPlanner(num_blocks=128, max_rows=2)
    runner = _runner(checkpoint)
    first = shared.add(_prompt(1, 30), penalised)
    _generate(runner, shared, 10)
    row = shared._sequences[first].row
    shared.finish(first)
    second = shared.add(_prompt(2, 20), penalised)
    _generate(runner, shared, 12)
    assert shared._sequences[second].row == row
    assert shared.output_tokens(second) == alone.output_tokens(second_alone)


def test_seeded_request_alone_and_in_a_mixed_batch(checkpoint):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    planner = HandPlanner(num_blocks=128, max_rows=8)
    alone_id = planner.add(_prompt(3, 25), seeded)
    _generate(_runner(checkpoint, seed=1), planner, 20, chunk=8)
    mixed = HandPlanner(num_blocks=128, max_rows=8, seed=9)
    for index in range(3):
        mixed.add(_prompt(10 + index, 7 + 11 * index), SamplingParams(temperature=0.8))
    mixed_id = mixed.add(_prompt(3, 25), seeded)
    mixed.add(_prompt(20, 40), SamplingParams(temperature=1.2, seed=7))
    _generate(_runner(checkpoint, seed=2), mixed, 20, chunk=16)
    alone_tokens = planner.output_tokens(alone_id)
    assert len(alone_tokens) >= 15
    assert mixed.output_tokens(mixed_id)[: len(alone_tokens)] == alone_tokens


def test_penalties_and_logprobs_over_prompt_and_generated_tokens(checkpoint):
    runner = _runner(checkpoint)
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.9, logprobs=4
    )
    prompt = [5, 6, 7, 5] + _prompt(4, 12)
    planner = HandPlanner(num_blocks=128, max_rows=8)
    seq_id = planner.add(prompt, params)
    for _ in range(12):
        plan = planner.next_plan()
        generated = list(planner.output_tokens(seq_id))
        out = runner.execute(plan, return_logits=True)
        raw = out.logits[0]
        expected = raw.clone()
        for token in set(prompt) | set(generated):
            value = float(expected[token])
            expected[token] = value / 1.8 if value > 0 else value * 1.8
        for token in set(generated):
            expected[token] -= 0.9 * generated.count(token) + 0.7
        expected_logprobs = expected.log_softmax(-1)
        assert out.sampled_token_ids[0] == int(expected.argmax())
        top = expected_logprobs.topk(4)
        np.testing.assert_allclose(out.logprobs.top_logprobs[0], top.values.numpy(), rtol=1e-5, atol=1e-5)
        assert out.logprobs.sampled_ranks[0] == 1
        planner.record(plan, out.sampled_token_ids)
    assert len(set(planner.output_tokens(seq_id))) > 6  # the penalties keep it from looping


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_pooling_matches_transformers_hidden_states(checkpoint, pooling_type):
    runner = _runner(checkpoint)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    prompts = [_prompt(5, 17), _prompt(6, 33)]
    planner = HandPlanner(num_blocks=128, max_rows=8)
    generating = planner.add(_prompt(7, 9))
    for prompt in prompts:
        planner.add(prompt, PoolingParams(pooling_type=pooling_type, normalize=prompt is prompts[0]))
    plan = planner.next_plan(max_chunk=4)
    out = runner.execute(plan)
    assert plan.pool_indices.tolist() == [1, 2] and out.sampled_token_ids.shape == (0,)
    assert out.pooled.shape == (2, 64)
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            hidden = reference.model(torch.tensor([prompt])).last_hidden_state[0]
        expected = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling_type]
        if index == 0:
            expected = torch.nn.functional.normalize(expected, dim=-1)
        torch.testing.assert_close(out.pooled[index], expected, atol=1e-5, rtol=1e-5)
    plan = planner.next_plan(max_chunk=4)
    assert sorted(plan.freed_rows.tolist()) == [1, 2]  # pooled sequences end after their step
    planner.record(plan, runner.execute(plan).sampled_token_ids)
    _generate(runner, planner, 2, chunk=4)  # 9-token prompt: chunks 4, 4, 1, then a decode
    assert len(planner.output_tokens(generating)) == 2


def test_unknown_new_sequence_is_a_clear_error(checkpoint):
    runner = _runner(checkpoint)
    planner = HandPlanner(num_blocks=128, max_rows=8)
    planner.add(_prompt(8, 5))
    plan = planner.next_plan()
    plan.new_params = [None]
    with pytest.raises(PlanStateError, match="no parameters given for new sequence 1"):
        runner.execute(plan)


def test_max_model_len_beyond_the_model_is_refused(checkpoint):
    with pytest.raises(ValueError, match="max_model_len"):
        _runner(checkpoint, max_model_len=10**6)


def test_token_budget_chunks_prefill_without_changing_results(checkpoint):
    prompts = [_prompt(30 + i, 20 + 7 * i) for i in range(4)]
    results = []
    for budget in (None, 24):
        runner = _runner(checkpoint)
        planner = HandPlanner(num_blocks=128, max_rows=8)
        ids = [planner.add(p) for p in prompts]
        for _ in range(12):
            plan = planner.next_plan(max_tokens=budget)
            assert budget is None or len(plan.input_ids) <= budget
            planner.record(plan, runner.execute(plan).sampled_token_ids)
        results.append([planner.output_tokens(i)[:4] for i in ids])
    assert results[0] == results[1] and all(len(t) == 4 for t in results[1])


def test_preempted_sequence_resumes_with_its_history(checkpoint):
    params = SamplingParams(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.8, min_tokens=12)
    runner = _runner(checkpoint)
    straight = HandPlanner(num_blocks=128, max_rows=8)
    reference = straight.add(_prompt(40, 18), params)
    _generate(runner, straight, 16)
    runner = _runner(checkpoint)
    interrupted = HandPlanner(num_blocks=128, max_rows=8, seed=4)
    other = interrupted.add(_prompt(41, 9))
    seq_id = interrupted.add(_prompt(40, 18), params)
    _generate(runner, interrupted, 6)
    interrupted.preempt(seq_id)
    interrupted.finish(other)
    plan = interrupted.next_plan()
    assert plan.new_num_prompt_tokens.tolist() == [18] and len(plan.new_token_ids) == 18 + 6
    interrupted.record(plan, runner.execute(plan).sampled_token_ids)
    _generate(runner, interrupted, 9)
    assert interrupted.output_tokens(seq_id) == straight.output_tokens(reference)
