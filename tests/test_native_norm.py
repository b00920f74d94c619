"""The native RMSNorm (with the residual add) and q/k norm + rotary kernels against the
PyTorch formulas they replace, through the model layers that call them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import _kernels
from pyengine.models.config import parse_decoder_config
from pyengine.models.layers import DecoderAttention, RMSNorm
from pyengine.models.parallel import ParallelContext
from pyengine.models.rope import RotaryEmbedding, apply_rotary


def _norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-6).requires_grad_(False)
    norm.weight.copy_(torch.randn(size, generator=torch.Generator().manual_seed(seed)))
    return norm


def _formula(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("rows", [1, 33, 3000])  # 3000 x 256 floats runs on two threads
def test_rms_norm_and_add_and_norm(rows):
    norm = _norm(256, 1)
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 256, generator=gen) * 3, torch.randn(rows, 256, generator=gen)
    torch.testing.assert_close(norm(x), _formula(x, norm.weight), rtol=1e-5, atol=1e-5)
    stream = residual.clone()
    torch.testing.assert_close(norm.add_and_norm(x, stream), _formula(residual + x, norm.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stream, residual + x)  # the stream is updated in place


def test_fallback_paths_agree_with_the_native_ones():
    norm = _norm(64, 2)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    native = norm(x)
    strided = torch.randn(5, 128)[:, ::2]  # not contiguous: the PyTorch path
    strided.copy_(x)
    torch.testing.assert_close(norm(strided), native, rtol=1e-5, atol=1e-6)
    stream_a, stream_b = torch.ones(5, 64), torch.ones(5, 128)[:, ::2]
    torch.testing.assert_close(norm.add_and_norm(x, stream_b), norm.add_and_norm(x, stream_a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_attention_q_k_norm_and_rotary_match_the_operator_path(qk_norm):
    config = parse_decoder_config({
        "architectures": ["Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"],
        "model_type": "qwen3" if qk_norm else "llama",
        "vocab_size": 64, "hidden_size": 96, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "rope_theta": 10000.0,
    })
    attention = DecoderAttention(config, 0, ParallelContext()).requires_grad_(False)
    gen = torch.Generator().manual_seed(3)
    for parameter in attention.parameters():
        parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.2)
    rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
    positions = torch.randint(0, 512, (37,), generator=gen)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    hidden = torch.randn(37, 96, generator=gen)

    seen = {}

    class Capture:
        def attend(self, layer_index, q, k, v, spec=None):
            seen.setdefault("qkv", []).append((q.clone(), k.clone(), v.clone()))
            return q

    attention(hidden, cos, sin, Capture())
    q, k, v = attention.qkv_proj(hidden).split(attention._split, dim=-1)
    q, k = q.reshape(37, 4, 24), k.reshape(37, 2, 24)
    if qk_norm:
        q, k = _formula(q, attention.q_norm.weight), _formula(k, attention.k_norm.weight)
    expected = (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.reshape(37, 2, 24))
    for got, want in zip(seen["qkv"][0], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    attention.requires_grad_(True)  # trainable weights: the operator path, same values
    with torch.no_grad():
        attention(hidden, cos, sin, Capture())
    for got, want in zip(seen["qkv"][1], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernels_refuse_bad_shapes_with_value_error():
    weight = np.ones(8, dtype=np.float32)
    with pytest.raises(ValueError, match="whole rows"):
        _kernels.rms_norm(np.zeros(12, np.float32), np.zeros(12, np.float32), weight, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        _kernels.rms_norm(np.zeros(16, np.float32), np.zeros(16, np.float32), weight, 1e-6, np.zeros(8, np.float32))
    table = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="row_stride"):
        _kernels.qk_norm_rope(np.zeros((2, 8), np.float32), table, table, 1, 1)
    with pytest.raises(ValueError, match="one row per token"):
        _kernels.qk_norm_rope(np.zeros((3, 16), np.float32), table, table, 1, 1)


def test_kernels_refuse_arguments_that_share_memory():
    x, weight = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="residual shares memory with x"):
        _kernels.rms_norm(torch.empty(4, 8).numpy(), x.numpy(), weight.numpy(), 1e-6, x.numpy())
    with pytest.raises(ValueError, match="out shares memory with x"):
        _kernels.rms_norm(x.numpy(), x.numpy(), weight.numpy(), 1e-6)
    qkv = torch.randn(3, 16)
    with pytest.raises(ValueError, match="qkv shares memory with cos"):
        _kernels.qk_norm_rope(qkv.numpy(), qkv[:, :8].numpy(), torch.randn(3, 8).numpy(), 1, 1)
