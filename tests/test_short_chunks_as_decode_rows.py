"""A step of short chunks (a verification step's ``1 + d`` entries) attended as one row
per token by the native decode kernel (``metadata.as_decode_rows``) equals causal
attention over each sequence, windowed and soft-capped layers included, and equals the
chunk path it replaces; longer chunks keep that path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyengine.executor.attention.metadata import StepAttentionLayout, as_decode_rows
from pyengine.executor.attention.sdpa import MAX_EXPANDED_QUERIES, SdpaBackend
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache
from pyengine.models.layers import FULL_ATTENTION, LayerAttention

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _step(seq_lens: list[int], counts: list[int], seed: int = 0):
    """A cache whose earlier context is filled at random, and a step scheduling
    ``counts[i]`` tokens ending at each sequence's ``seq_lens[i]``: its layout, q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(widths) + 2
    cache = PagedKVCache(KVCacheShape(1, KV_HEADS, HEAD_DIM, BLOCK, torch.float32), num_blocks, torch.device("cpu"))
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    slots, at = [], 0
    for row, (n, c) in enumerate(zip(seq_lens, counts)):
        tables[row, : widths[row]] = ids[at : at + widths[row]].to(torch.int32)
        at += widths[row]
        for p in range(n - c, n):
            slots.append(int(tables[row, p // BLOCK]) * BLOCK + p % BLOCK)
    tokens = sum(counts)
    layout = StepAttentionLayout(
        query_start_loc=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32), num_scheduled_tokens=np.array(counts, dtype=np.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables, block_size=BLOCK)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    return cache, layout, q, k, v


def _reference(cache, layout, q, k, v, spec: LayerAttention) -> torch.Tensor:
    """Each sequence's causal attention over its context with this step's K/V written,
    computed plainly."""
    keys, values = cache.keys[0].clone(), cache.values[0].clone()
    keys.view(-1, KV_HEADS, HEAD_DIM)[layout.slot_mapping] = k
    values.view(-1, KV_HEADS, HEAD_DIM)[layout.slot_mapping] = v
    out = torch.empty_like(q)
    for row, n in enumerate(layout.seq_lens.tolist()):
        start, end = int(layout.query_start_loc[row]), int(layout.query_start_loc[row + 1])
        blocks = layout.block_tables[row, : -(-n // BLOCK)].long()
        kk = keys[blocks].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        vv = values[blocks].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        scores = q[start:end].transpose(0, 1) @ kk.transpose(1, 2) * spec.score_scale(HEAD_DIM)
        if spec.softcap is not None:
            scores = spec.softcap * torch.tanh(scores / spec.softcap)
        query_pos = torch.arange(n - (end - start), n)[:, None]
        key_pos = torch.arange(n)[None, :]
        visible = key_pos <= query_pos
        if spec.window is not None:
            visible &= key_pos > query_pos - spec.window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (F.softmax(scores, dim=-1) @ vv).transpose(0, 1)
    return out


def test_the_expanded_layout_gives_each_token_its_sequences_table_and_causal_length():
    _, layout, *_ = _step([9, 3, 14], [3, 1, 5])
    rows = as_decode_rows(layout)
    assert rows.num_scheduled_tokens.tolist() == [1] * 9
    assert rows.query_start_loc.tolist() == list(range(10))
    assert rows.seq_lens.tolist() == [7, 8, 9, 3, 10, 11, 12, 13, 14]
    owners = [0, 0, 0, 1, 2, 2, 2, 2, 2]
    assert torch.equal(rows.block_tables, layout.block_tables[owners])
    assert rows.slot_mapping is layout.slot_mapping


SPECS = [FULL_ATTENTION, LayerAttention(window=5), LayerAttention(softcap=3.0), LayerAttention(scale=0.3)]


@pytest.mark.parametrize("spec", SPECS, ids=["full", "window", "softcap", "scale"])
@pytest.mark.parametrize("seq_lens, counts", [
    ([9, 3, 14, 5], [3, 1, 5, 5]),  # verification-like rows, one whole fresh prompt of 5
    ([40], [MAX_EXPANDED_QUERIES]),  # the longest chunk expanded
    ([2, 2], [2, 2]),  # two fresh prompts, no earlier context
])
def test_short_chunks_attended_as_decode_rows_equal_causal_attention(spec, seq_lens, counts):
    cache, layout, q, k, v = _step(seq_lens, counts)
    step = SdpaBackend().bind(cache, layout)
    assert step.all_single, "short chunks go to the decode kernel"
    expanded = step.attend(0, q, k, v, spec)
    torch.testing.assert_close(expanded, _reference(cache, layout, q, k, v, spec), rtol=1e-5, atol=1e-5)
    chunk_cache, *_ = _step(seq_lens, counts)  # the same random cache, through the chunk path
    chunked = SdpaBackend(native_decode=False).bind(chunk_cache, layout).attend(0, q, k, v, spec)
    torch.testing.assert_close(expanded, chunked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.keys, chunk_cache.keys, rtol=0, atol=0)  # the same K/V written


def test_a_longer_chunk_keeps_the_chunk_path():
    cache, layout, q, k, v = _step([30, 4], [MAX_EXPANDED_QUERIES + 1, 1])
    step = SdpaBackend().bind(cache, layout)
    assert not step.all_single and len(step.chunks) == 1
    torch.testing.assert_close(step.attend(0, q, k, v, FULL_ATTENTION),
                               _reference(cache, layout, q, k, v, FULL_ATTENTION), rtol=1e-5, atol=1e-5)

