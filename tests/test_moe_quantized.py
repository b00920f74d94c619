"""Mixture-of-experts models quantized at load (``quantization="int8"`` / ``"int4"``): the
routed experts are quantized with the linears (the routers stay float), and the model
matches Hugging Face transformers running the dequantized weights: prefill logits within
float32 rounding, greedy tokens equal (decode steps run the native integer kernels); at
tensor parallel size 2 the logits of size 1."""

from __future__ import annotations

import pytest

from pyengine.models.moe import SparseMoeBlock
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.quantized_parity import (
    assert_greedy_matches_dequantized,
    assert_prefill_matches_dequantized,
    quantized_runner,
)
from pyengine.testing.tp_ranks import check_two_ranks_match_one

# Every input width a multiple of 128 (int4's group): hidden, expert and shared sizes.
SHAPES = {
    "qwen3_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64),
    "qwen2_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
    "mixtral": dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
}
ATOL, RTOL = 1e-4, 1e-4
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [8, 9, 10]]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **SHAPES[request.param])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_prefill_logits_match_the_dequantized_reference(checkpoint, method, tmp_path):
    runner = quantized_runner(checkpoint, method)
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.experts.quantized is not None and b.experts.gate_up.device.type == "meta" for b in blocks)
    assert all(b.experts.quantized.gate_up_weight.bits == int(method[-1]) for b in blocks)
    assert_prefill_matches_dequantized(runner, checkpoint, tmp_path, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_greedy_tokens_equal_the_dequantized_reference(checkpoint, method, tmp_path):
    assert_greedy_matches_dequantized(checkpoint, method, tmp_path, PROMPTS)


def test_int4_experts_at_tensor_parallel_two_give_the_logits_of_one(tmp_path):
    """Each rank quantizes its slice of every expert; with every rank's share of the
    experts' (and attention's, MLP's) input features a multiple of int4's group of 128,
    the integers are those of the whole weight cut, so two ranks give one rank's logits.
    (int8's one scale per output channel is taken over a row-parallel shard's columns: a
    different quantization at each size, for the dense linears as for the experts.)"""
    shape = dict(SHAPES["qwen3_moe"], moe_intermediate_size=256)  # 128 features per rank
    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen3_moe", **shape)
    check_two_ranks_match_one(checkpoint, tmp_path, PROMPTS, 6, quantization="int4", atol=ATOL, rtol=RTOL)
