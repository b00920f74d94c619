"""The native CPU decode-attention kernel (`pyengine._kernels.paged_decode_attention`)
against PyTorch SDPA over the gathered context, and its argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyengine import _kernels


def _case(rows, heads, kv_heads, head_dim, block_size, seq_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = rows * width + 3
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: rows * width].view(rows, width).to(torch.int32)
    query = torch.randn(rows, heads, head_dim, generator=gen)
    return query, keys, values, tables, np.array(seq_lens, dtype=np.int32)


def _reference(query, keys, values, tables, seq_lens):
    rows, heads, head_dim = query.shape
    out = torch.empty_like(query)
    for row in range(rows):
        n = int(seq_lens[row])
        blocks = tables[row, : -(-n // keys.shape[1])].long()
        k = keys[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [kv_heads, n, d]
        v = values[blocks].flatten(0, 1)[:n].transpose(0, 1)
        out[row] = F.scaled_dot_product_attention(query[row][:, None], k, v, enable_gqa=True)[:, 0]
    return out


def _native(query, keys, values, tables, seq_lens, threads=1):
    out = torch.full_like(query, float("nan"))
    _kernels.paged_decode_attention(
        out.numpy(), query.numpy(), keys.numpy(), values.numpy(), tables.numpy(), seq_lens,
        query.shape[-1] ** -0.5, threads,
    )
    return out


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size",
    [(4, 2, 64, 16), (8, 1, 128, 16), (6, 3, 24, 4), (2, 2, 20, 8)],  # 20: the portable path
)
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_sdpa_over_gathered_context(heads, kv_heads, head_dim, block_size, threads):
    seq_lens = [1, 17, 200, 33, 64, 5, 129]
    case = _case(len(seq_lens), heads, kv_heads, head_dim, block_size, seq_lens)
    torch.testing.assert_close(_native(*case, threads=threads), _reference(*case), rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite():
    query, keys, values, tables, seq_lens = _case(3, 4, 2, 64, 16, [300, 40, 1])
    query *= 40.0  # scores in the thousands: the softmax must subtract the maximum
    out = _native(query, keys, values, tables, seq_lens, threads=2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(query, keys, values, tables, seq_lens), rtol=1e-4, atol=1e-4)


def test_bad_arguments_raise_value_error():
    query, keys, values, tables, seq_lens = _case(2, 4, 2, 64, 16, [20, 30])
    out = torch.empty_like(query)

    def call(**changes):
        args = dict(
            out=out.numpy(), query=query.numpy(), key_cache=keys.numpy(), value_cache=values.numpy(),
            block_tables=tables.numpy(), seq_lens=seq_lens, scale=0.125,
        )
        args.update(changes)
        _kernels.paged_decode_attention(**args)

    call()  # the unchanged arguments are fine
    with pytest.raises(ValueError, match="sequence length 33"):
        call(seq_lens=np.array([20, 33], dtype=np.int32))  # beyond the table's 2 blocks
    with pytest.raises(ValueError, match="block id"):
        call(block_tables=np.full_like(tables.numpy(), 10_000))
    with pytest.raises(ValueError, match="C-contiguous"):
        call(query=torch.randn(2, 64, 4).transpose(1, 2).numpy())
    with pytest.raises(ValueError, match="multiple"):
        call(query=torch.randn(2, 3, 64).numpy(), out=torch.empty(2, 3, 64).numpy())
    with pytest.raises(ValueError, match="must match"):
        call(value_cache=values[:-1].numpy())
    with pytest.raises(TypeError):
        call(query=query.double().numpy())
    with pytest.raises(ValueError, match="out shares memory with query"):
        call(out=query.numpy())


def test_contiguous_reference_with_the_native_kernel_matches_sdpa(tmp_path):
    from pyengine.models.loader import load_model
    from pyengine.testing.checkpoints import make_tiny_checkpoint
    from pyengine.testing.contiguous_reference import ContiguousKVCache, NativeDecodeKVCache, contiguous_step

    model = load_model(make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")).model
    prompts = torch.randint(0, 512, (3, 37), generator=torch.Generator().manual_seed(0))
    logits = []
    for cache_type in (ContiguousKVCache, NativeDecodeKVCache):
        cache = cache_type(model, 3, 48)
        steps = [contiguous_step(model, cache, prompts)]
        for _ in range(4):
            steps.append(contiguous_step(model, cache, steps[-1].argmax(-1, keepdim=True)))
        logits.append(torch.stack(steps))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 7, 16, 50])
def test_a_window_equals_attention_over_the_last_positions(window):
    """``window`` = the same attention over the last ``window`` positions only, whose
    blocks start mid-table and mid-block."""
    seq_lens = [1, 17, 200, 33, 64, 5, 129]
    query, keys, values, tables, lens = _case(len(seq_lens), 4, 2, 64, 16, seq_lens)
    out = torch.full_like(query, float("nan"))
    _kernels.paged_decode_attention(
        out.numpy(), query.numpy(), keys.numpy(), values.numpy(), tables.numpy(), lens, 64**-0.5, 2,
        window=window,
    )
    expected = torch.empty_like(query)
    for row, n in enumerate(seq_lens):
        blocks = tables[row, : -(-n // 16)].long()
        first = max(0, n - window)
        k = keys[blocks].flatten(0, 1)[first:n].transpose(0, 1)
        v = values[blocks].flatten(0, 1)[first:n].transpose(0, 1)
        expected[row] = F.scaled_dot_product_attention(query[row][:, None], k, v, enable_gqa=True)[:, 0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_softcap_caps_the_scores_before_the_softmax():
    seq_lens = [9, 40]
    query, keys, values, tables, lens = _case(2, 4, 2, 64, 16, seq_lens)
    query *= 5.0
    out = torch.empty_like(query)
    _kernels.paged_decode_attention(
        out.numpy(), query.numpy(), keys.numpy(), values.numpy(), tables.numpy(), lens, 0.125, 1, softcap=3.0
    )
    for row, n in enumerate(seq_lens):
        blocks = tables[row, : -(-n // 16)].long()
        k = keys[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [kv_heads, n, d]
        v = values[blocks].flatten(0, 1)[:n].transpose(0, 1)
        q = query[row].view(2, 2, 64)
        scores = torch.tanh(q @ k.transpose(1, 2) * 0.125 / 3.0) * 3.0
        expected = (torch.softmax(scores, -1) @ v).reshape(4, 64)
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        _kernels.paged_decode_attention(
            out.numpy(), query.numpy(), keys.numpy(), values.numpy(), tables.numpy(), lens, 0.125, 1, softcap=-1.0
        )
