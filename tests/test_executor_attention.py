"""Attention backends: flash-attn's call pattern checked on CPU against a reference kernel,
backend selection, and CUDA-only parity (SDPA and flash-attn) where a GPU exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyengine.executor.attention.flash import FlashAttentionBackend, import_flash_varlen
from pyengine.executor.attention.selector import AttentionBackendUnavailableError, select_attention_backend
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner


def reference_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, block_table=None
):
    """What flash_attn_varlen_func computes (bottom-right causal), written plainly."""
    assert (
        causal
        and q.dtype == k.dtype
        and cu_seqlens_q.dtype == torch.int32
        and cu_seqlens_k.dtype == torch.int32
    )
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        length = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        if block_table is None:
            keys = k[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])]
            values = v[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])]
        else:
            assert block_table.dtype == torch.int32
            blocks = block_table[i, : -(-length // k.shape[1])].long()
            keys = k[blocks].flatten(0, 1)[:length]
            values = v[blocks].flatten(0, 1)[:length]
        query_len = qe - qs
        mask = torch.arange(length)[None, :] <= torch.arange(length - query_len, length)[:, None]
        result = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )
        out[qs:qe] = result.transpose(0, 1)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def _generate(runner, block_size, steps=24):
    planner = HandPlanner(block_size=block_size, num_blocks=runner.num_kv_blocks, max_rows=4, seed=3)
    rng = np.random.default_rng(0)
    ids = [
        planner.add(rng.integers(0, 512, size=n).tolist(), SamplingParams(temperature=0.0))
        for n in (30, 7, 19)
    ]
    logits = []
    for _ in range(steps):
        plan = planner.next_plan(max_chunk=12)
        out = runner.execute(plan, return_logits=True)
        logits.append(out.logits)
        planner.record(plan, out.sampled_token_ids)
    return [planner.output_tokens(i) for i in ids], logits


@pytest.mark.parametrize("block_size", [16, 256])  # gathered context / direct block_table
def test_flash_backend_call_pattern_matches_sdpa(checkpoint, block_size):
    config = ExecutorConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=64, block_size=block_size)
    sdpa = ModelRunner.from_pretrained(checkpoint, config)
    flash = ModelRunner.from_pretrained(checkpoint, config)
    flash.attention_backend = FlashAttentionBackend(reference_varlen)
    expected_tokens, expected_logits = _generate(sdpa, block_size)
    tokens, logits = _generate(flash, block_size)
    assert tokens == expected_tokens
    for ours, theirs in zip(logits, expected_logits):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_backend_selection_on_cpu():
    cpu = torch.device("cpu")
    assert select_attention_backend("auto", cpu, torch.float32).name == "sdpa"
    assert select_attention_backend("sdpa", cpu, torch.float32).name == "sdpa"
    with pytest.raises(AttentionBackendUnavailableError, match="needs CUDA"):
        select_attention_backend("flash_attn", cpu, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sdpa_matches_cpu(checkpoint):
    settings = dict(
        max_num_seqs=4, max_model_len=256, num_kv_blocks=64, dtype="float32", attention_backend="sdpa"
    )
    cpu_tokens, cpu_logits = _generate(
        ModelRunner.from_pretrained(checkpoint, ExecutorConfig(**settings)), 16
    )
    cuda = ModelRunner.from_pretrained(checkpoint, ExecutorConfig(device="cuda", block_size=16, **settings))
    tokens, logits = _generate(cuda, cuda.block_size)
    assert tokens == cpu_tokens
    for ours, theirs in zip(logits, cpu_logits):
        torch.testing.assert_close(ours.cpu(), theirs, atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(
    not torch.cuda.is_available() or import_flash_varlen() is None, reason="needs CUDA and flash-attn"
)
@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_flash_attn_matches_sdpa(checkpoint, block_size):
    settings = dict(
        max_num_seqs=4,
        max_model_len=256,
        num_kv_blocks=64,
        dtype="bfloat16",
        device="cuda",
        block_size=block_size,
    )
    sdpa_tokens, sdpa_logits = _generate(
        ModelRunner.from_pretrained(checkpoint, ExecutorConfig(attention_backend="sdpa", **settings)),
        block_size,
    )
    flash = ModelRunner.from_pretrained(
        checkpoint, ExecutorConfig(attention_backend="flash_attn", **settings)
    )
    assert flash.attention_backend.name == "flash_attn"
    tokens, logits = _generate(flash, block_size)
    first_logits_close = all(
        torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.05)
        for a, b in zip(logits[:4], sdpa_logits[:4])
    )
    assert first_logits_close
    agreement = np.mean([a == b for x, y in zip(tokens, sdpa_tokens) for a, b in zip(x, y)])
    assert agreement > 0.9  # bfloat16 kernels may flip a near-tie; most tokens must agree


def test_cpu_key_tiles_match_one_tile(checkpoint, monkeypatch):
    import pyengine.executor.attention.sdpa as sdpa

    config = ExecutorConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=64, dtype="bfloat16")
    expected_tokens, expected_logits = _generate(ModelRunner.from_pretrained(checkpoint, config), 16)
    monkeypatch.setattr(sdpa, "CPU_TILE_BYTES", 1)  # one row per key tile (bfloat16 uses tiles)
    tokens, logits = _generate(ModelRunner.from_pretrained(checkpoint, config), 16)
    assert tokens == expected_tokens
    for ours, theirs in zip(logits, expected_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_bfloat16_on_cpu_runs_and_tracks_float32(checkpoint):
    settings = dict(max_num_seqs=4, max_model_len=256, num_kv_blocks=64)
    _, logits32 = _generate(
        ModelRunner.from_pretrained(checkpoint, ExecutorConfig(dtype="float32", **settings)), 16, 6
    )
    runner16 = ModelRunner.from_pretrained(checkpoint, ExecutorConfig(dtype="bfloat16", **settings))
    assert runner16.kv_cache.keys.dtype == torch.bfloat16
    _, logits16 = _generate(runner16, 16, 6)
    for step in (0, 1, 2):  # prefill chunks and the first decodes (single-query path)
        assert torch.allclose(logits16[step].float(), logits32[step], atol=0.15)


def test_old_flash_attn_without_block_table_gathers_context():
    def old_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
        raise AssertionError("not called")

    assert FlashAttentionBackend(reference_varlen).supports_block_table
    assert not FlashAttentionBackend(old_varlen).supports_block_table
