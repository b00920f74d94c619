"""The plain SDPA backend's prefill chunks after cached context, their context read and
attended a slice at a time (log-sum-exp merge, ``attention/sliced.py``), against the
whole context in one call and a naive computation: grouped queries, soft-capped scores,
slices of a block, not of a block and smaller than one, chunks ending inside a block,
and sequences of different contexts in one step with decodes and a fresh prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.errors import InvalidConfigError
from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.attention.sdpa import SdpaBackend, SdpaStepAttention
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache
from pyengine.models.layers import FULL_ATTENTION, LayerAttention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def _step(seq_lens: list[int], scheduled: list[int], seed: int = 0):
    """A cache with each row's earlier context written, the step's layout, q / k / v of
    the step's tokens, and every row's whole keys and values (for the naive reference)."""
    rng = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in seq_lens)
    cache = PagedKVCache(KVCacheShape(1, KV_HEADS, DIM, BLOCK, torch.float32), len(seq_lens) * width + 1,
                         torch.device("cpu"))
    permutation = torch.randperm(cache.num_blocks - 1, generator=rng)[: len(seq_lens) * width] + 1
    tables = permutation.view(len(seq_lens), width).to(torch.int32)
    key_slots, value_slots = cache.layer_slots(0)
    contexts, slots = [], []
    for row, (length, new) in enumerate(zip(seq_lens, scheduled)):
        keys, values = torch.randn(length, KV_HEADS, DIM, generator=rng), torch.randn(length, KV_HEADS, DIM, generator=rng)
        contexts.append((keys, values))
        positions = torch.arange(length)
        row_slots = tables[row].long()[positions // BLOCK] * BLOCK + positions % BLOCK
        key_slots[row_slots[: length - new]] = keys[: length - new]
        value_slots[row_slots[: length - new]] = values[: length - new]
        slots.append(row_slots[length - new :])
    starts = np.concatenate([[0], np.cumsum(scheduled)])
    layout = StepAttentionLayout(
        query_start_loc=starts, seq_lens=np.array(seq_lens), num_scheduled_tokens=np.array(scheduled),
        slot_mapping=torch.cat(slots), block_tables=tables, block_size=BLOCK,
    )
    q = torch.randn(int(starts[-1]), HEADS, DIM, generator=rng) * 2  # large enough scores for the cap to bite
    k = torch.cat([keys[len(keys) - n :] for (keys, _), n in zip(contexts, scheduled)])
    v = torch.cat([values[len(values) - n :] for (_, values), n in zip(contexts, scheduled)])
    return cache, layout, q, k, v, contexts


def _naive(q, contexts, scheduled, spec):
    out, start = [], 0
    for (keys, values), new in zip(contexts, scheduled):
        for i in range(new):
            seen = len(keys) - new + i + 1
            heads = []
            for h in range(HEADS):
                scores = keys[:seen, h // (HEADS // KV_HEADS)] @ q[start + i, h] * spec.score_scale(DIM)
                if spec.softcap is not None:
                    scores = spec.softcap * torch.tanh(scores / spec.softcap)
                heads.append(torch.softmax(scores, dim=-1) @ values[:seen, h // (HEADS // KV_HEADS)])
            out.append(torch.stack(heads))
        start += new
    return torch.stack(out)


@pytest.mark.parametrize("spec", [FULL_ATTENTION, LayerAttention(softcap=3.0)], ids=["plain", "softcap"])
@pytest.mark.parametrize("slice_rows", [4, 5, 3, 1])
def test_chunks_after_cached_context_in_slices_match_the_whole_context(spec, slice_rows):
    # decodes, chunks of 6 / 3 tokens after 21 / 9 cached rows (ending inside blocks), a fresh prompt
    seq_lens, scheduled = [9, 27, 13, 12, 7], [1, 6, 1, 3, 7]
    cache, layout, q, k, v, contexts = _step(seq_lens, scheduled, seed=slice_rows)
    # native_decode=False: chunks this short would otherwise go to the decode kernel a row
    # per token (``metadata.as_decode_rows``), compared last.
    whole = SdpaStepAttention(cache, layout, native_decode=False, slice_rows=1024).attend(0, q, k, v, spec)
    sliced = SdpaStepAttention(cache, layout, native_decode=False, slice_rows=slice_rows).attend(0, q, k, v, spec)
    expected = _naive(q, contexts, scheduled, spec)
    rows = SdpaStepAttention(cache, layout).attend(0, q, k, v, spec)
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sliced, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=1e-5)


def test_the_sliced_path_reads_at_most_a_slice_of_blocks_at_once(monkeypatch):
    """The context is never gathered whole: each read covers the blocks of one slice."""
    from pyengine.executor.attention import sdpa

    seq_lens, scheduled = [41], [5]
    cache, layout, q, k, v, contexts = _step(seq_lens, scheduled, seed=9)
    reads = []
    real = sdpa.cached_rows

    def counting(blocks, table, start, end):
        reads.append(end - start)
        return real(blocks, table, start, end)

    monkeypatch.setattr(sdpa, "cached_rows", counting)
    out = SdpaStepAttention(cache, layout, native_decode=False, slice_rows=8).attend(0, q, k, v, FULL_ATTENTION)
    torch.testing.assert_close(out, _naive(q, contexts, scheduled, FULL_ATTENTION), atol=1e-5, rtol=1e-5)
    assert reads == [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 1, 1]  # keys and values of each slice


def test_the_profile_chunk_and_slice_size_checks():
    backend = SdpaBackend(slice_rows=64)
    assert backend.profile_steps(256, 4096, None) == [(256, 64, backend)]  # one full slice before the chunk
    assert backend.profile_steps(256, 300, None) == [(256, 44, backend)]  # as far as max_model_len lets it
    assert backend.profile_steps(256, 256, None) == []  # no context ever before a full chunk
    # A hybrid model's per-group tables wrap the backend: its profile steps are the same.
    from pyengine.executor.attention.tables import TableAttentionBackend

    assert TableAttentionBackend(backend, (0, 1)).profile_steps(256, 4096, None) == [(256, 64, backend)]
    with pytest.raises(InvalidConfigError, match="slice_rows"):
        SdpaBackend(slice_rows=0)


def test_the_memory_profile_runs_a_full_chunk_after_a_slice_of_context(tmp_path):
    from pyengine.executor.config import ExecutorConfig
    from pyengine.executor.model_runner import ModelRunner
    from pyengine.testing.checkpoints import make_tiny_checkpoint

    runner = ModelRunner.from_pretrained(make_tiny_checkpoint(tmp_path / "qwen3", "qwen3"), ExecutorConfig(
        dtype="float32", max_num_seqs=2, max_model_len=128, block_size=4, num_kv_blocks=64, max_num_batched_tokens=32,
    ))
    steps = []

    class Recording(SdpaBackend):
        def bind(self, cache, layout):
            steps.append((layout.seq_lens.tolist(), layout.num_scheduled_tokens.tolist()))
            return super().bind(cache, layout)

    runner.attention_backend = Recording(slice_rows=16)
    runner._profile_forward()
    assert steps == [([48], [32]), ([32], [32])]
