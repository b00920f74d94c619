"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) against Hugging Face
transformers on tiny random checkpoints written per expert, as published ones are
(float32): prefill logits, greedy tokens and logits over chunked prefill and decode."""

from __future__ import annotations

import pytest
import torch
from test_models_parity import (
    _prompts,
    _run_generation,
    _runner,
    assert_prefill_matches_transformers,
)

from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.transformers_reference import reference_model

VARIANTS = {
    # norm_topk_prob on, a dense layer among the sparse ones (mlp_only_layers)
    "qwen3_moe_norm_topk": ("qwen3_moe", {}),
    # norm_topk_prob off, every layer sparse
    "qwen3_moe_raw_topk": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[])),
    # shared expert and its gate, decoder_sparse_step 2 (layer 1 sparse), qkv bias
    "qwen2_moe_shared_expert": ("qwen2_moe", {}),
    # block_sparse_moe names, w1/w3/w2, always renormalised; a sharded checkpoint
    "mixtral_sharded": ("mixtral", dict(max_shard_size="100KB")),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def test_prefill_logits_match_transformers(checkpoint):
    assert_prefill_matches_transformers(checkpoint)


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_then_decode_matches_generate(checkpoint, depth):
    runner, reference = _runner(checkpoint), reference_model(checkpoint)
    prompts = _prompts(2, (45, 9, 33))
    tokens, logits = _run_generation(runner, prompts, steps=36, chunk=16, scatter=True, depth=depth)
    for seq_id, prompt in zip(sorted(tokens), prompts):
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0]
        assert tokens[seq_id][:32] == theirs[len(prompt) :].tolist()
        with torch.no_grad():
            full = reference(theirs[None]).logits[0]
        expected = full[len(prompt) - 1 : len(prompt) - 1 + 32]
        torch.testing.assert_close(logits[seq_id][:32], expected, atol=5e-5, rtol=1e-5)


def test_moe_token_slices_give_the_same_result(checkpoint, monkeypatch):
    """A step longer than SparseMoeBlock.token_chunk routes and runs in slices: same output."""
    from pyengine.models.moe import SparseMoeBlock

    runner = _runner(checkpoint)
    block = next(layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    x = torch.randn(50, runner.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = block(x)
    monkeypatch.setattr(SparseMoeBlock, "token_chunk", 16)
    torch.testing.assert_close(block(x), whole, rtol=1e-5, atol=1e-6)
