"""Models quantized at load (``quantization="int8"`` / ``"int4"``) against Hugging Face
transformers running the dequantized weights: logits within float32 rounding of that
reference (the integer products are exact; only the order of the float sums differs),
greedy tokens equal, and tensor parallel size 2 giving the logits of size 1."""

from __future__ import annotations

import pytest

from pyengine.errors import InvalidConfigError
from pyengine.executor.config import ExecutorConfig
from pyengine.models.quantization.packed import QuantizationError
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.quantized_parity import (
    assert_greedy_matches_dequantized,
    assert_prefill_matches_dequantized,
    quantized_runner,
)
from pyengine.testing.tp_ranks import check_two_ranks_match_one

# Every input width a multiple of 128 (int4's group), also per rank at TP=2 (o_proj 256 -> 128).
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# Float32 rounding of sums over a few hundred products, through two layers.
ATOL, RTOL = 1e-4, 1e-4
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [8, 9, 10]]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q"), "qwen3", tie_word_embeddings=request.param, **SHAPE)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_prefill_logits_match_the_dequantized_reference(checkpoint, method, tmp_path):
    assert_prefill_matches_dequantized(quantized_runner(checkpoint, method), checkpoint, tmp_path, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_greedy_tokens_equal_the_dequantized_reference(checkpoint, method, tmp_path):
    assert_greedy_matches_dequantized(checkpoint, method, tmp_path, PROMPTS)


def test_int4_tensor_parallel_two_ranks_give_the_logits_of_one(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen3", tie_word_embeddings=True, **SHAPE)
    check_two_ranks_match_one(checkpoint, tmp_path, PROMPTS, 6, quantization="int4", atol=ATOL, rtol=RTOL)


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(InvalidConfigError, match="quantization must be None, 'int8', 'int4' or 'fp8'"):
        ExecutorConfig(quantization="awq")
    small = make_tiny_checkpoint(tmp_path / "small", "qwen3")  # hidden 64: not a multiple of 128
    with pytest.raises(QuantizationError, match="int4.*divisible by 128"):
        quantized_runner(small, "int4")
