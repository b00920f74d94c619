"""Our models against Hugging Face transformers on the same tiny random checkpoints (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.contiguous_reference import ContiguousKVCache, contiguous_step
from pyengine.testing.hand_plan import HandPlanner, prefill_alone
from pyengine.testing.transformers_reference import reference_model

VOCAB = 512
VARIANTS = {
    "llama": ("llama", {}),
    "llama_tied_mha": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama_linear_rope": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ),
    "llama3_rope_odd_heads": ("llama3", {}),
    "mistral_mqa": ("mistral", {}),
    "qwen2_bias": ("qwen2", {}),
    "qwen3_qk_norm": ("qwen3", {}),
    "qwen3_odd_heads": ("qwen3", dict(num_attention_heads=3, num_key_value_heads=1, head_dim=24)),
    # Sliding windows of 20 tokens (prompts and generations run past them), Gemma, Phi-3.
    "mistral_window": ("mistral_window", {}),
    "qwen2_window_layers": ("qwen2_window", {}),
    "gemma2_softcap": ("gemma2", {}),
    "gemma3_local_rope": ("gemma3", {}),
    "phi3_longrope_fused": ("phi3", {}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def _runner(path, **overrides) -> ModelRunner:
    config = ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=96, **overrides)
    return ModelRunner.from_pretrained(path, config)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


def test_prefill_logits_match_transformers(checkpoint):
    assert_prefill_matches_transformers(checkpoint)


def assert_prefill_matches_transformers(checkpoint):
    """A 70-token prompt prefilled alone: every position's logits within float32 rounding
    of transformers', and the sampled token its argmax."""
    runner, reference = _runner(checkpoint), reference_model(checkpoint)
    prompt = _prompts(1, (70,))[0]
    out, ours = prefill_alone(runner, prompt)
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    assert out.sampled_token_ids.tolist() == [int(theirs[-1].argmax())]


def _run_generation(runner, prompts, *, steps, chunk, scatter, depth, seed=0):
    """Greedy generation through hand plans; returns (tokens per seq, logits per seq)."""
    planner = HandPlanner(
        block_size=16, num_blocks=runner.num_kv_blocks, max_rows=8, scatter_blocks=scatter, seed=seed,
        tables=runner.num_kv_tables,
    )
    seq_ids = [planner.add(prompt, SamplingParams(temperature=0.0)) for prompt in prompts]
    logits = {seq_id: [] for seq_id in seq_ids}
    pending = []
    for _ in range(steps):
        plan = planner.next_plan(max_chunk=chunk)
        if depth == 2 and pending:
            planner.record(*pending.pop())
        out = runner.execute(plan, return_logits=True)
        row_to_seq = {int(r): s for s, r in zip(plan.new_seq_ids.tolist(), plan.new_rows.tolist())}
        _row_map(runner).update(row_to_seq)
        for index, row in enumerate(plan.sample_rows.tolist()):
            logits[_row_map(runner)[row]].append(out.logits[index].clone())
        if depth == 2:
            pending.append((plan, out.sampled_token_ids))
        else:
            planner.record(plan, out.sampled_token_ids)
    for item in pending:
        planner.record(*item)
    return {s: planner.output_tokens(s) for s in seq_ids}, {s: torch.stack(v) for s, v in logits.items()}


def _row_map(runner) -> dict:
    return runner.__dict__.setdefault("_test_row_to_seq", {})


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_then_decode_matches_generate(checkpoint, depth):
    runner, reference = _runner(checkpoint), reference_model(checkpoint)
    prompts = _prompts(2, (45, 9, 33))
    steps = 4 + 32  # the longest prompt takes 3 chunks of 16, then 32 decodes (+1 slack)
    tokens, logits = _run_generation(runner, prompts, steps=steps, chunk=16, scatter=True, depth=depth)
    for seq_id, prompt in zip(sorted(tokens), prompts):
        ours = tokens[seq_id][:32]
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0]
        assert ours == theirs[len(prompt) :].tolist()
        with torch.no_grad():
            full = reference(theirs[None]).logits[0]
        expected = full[len(prompt) - 1 : len(prompt) - 1 + 32]
        torch.testing.assert_close(logits[seq_id][:32], expected, atol=5e-5, rtol=1e-5)


def test_scattered_and_contiguous_blocks_agree(checkpoint):
    prompts = _prompts(3, (40, 21))
    scattered = _run_generation(
        _runner(checkpoint), prompts, steps=20, chunk=8, scatter=True, depth=2, seed=5
    )
    contiguous = _run_generation(_runner(checkpoint), prompts, steps=20, chunk=8, scatter=False, depth=2)
    assert scattered[0] == contiguous[0]
    for seq_id in scattered[1]:
        torch.testing.assert_close(scattered[1][seq_id], contiguous[1][seq_id], atol=1e-6, rtol=0)


def test_paged_runner_matches_contiguous_cache_forward(checkpoint):
    runner = _runner(checkpoint)
    prompts = _prompts(4, (24, 24, 24))
    tokens, logits = _run_generation(runner, prompts, steps=10, chunk=None, scatter=True, depth=1)
    cache = ContiguousKVCache(runner.model, batch=3, max_len=64)
    current = torch.tensor(prompts)
    for step in range(10):
        step_logits = contiguous_step(runner.model, cache, current)
        for row, seq_id in enumerate(sorted(tokens)):
            torch.testing.assert_close(logits[seq_id][step], step_logits[row], atol=2e-5, rtol=1e-5)
        current = torch.tensor([[tokens[seq_id][step]] for seq_id in sorted(tokens)])


def test_mlp_token_slices_give_the_same_result(checkpoint, monkeypatch):
    """A step longer than GatedMLP.token_chunk runs its MLP in slices: same logits."""
    runner = _runner(checkpoint)
    mlp = runner.model.layers[0].mlp
    x = torch.randn(50, runner.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = mlp(x)
    monkeypatch.setattr(type(mlp), "token_chunk", 16)
    torch.testing.assert_close(mlp(x), whole, rtol=1e-5, atol=1e-6)


def test_float32_rms_norm_fast_path_matches_the_reference_formula():
    from pyengine.models.layers import RMSNorm

    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(2)) * 3.0
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
