"""The default KV block size per device: on CUDA flash-attn must read the paged cache in
place (upstream flash-attn takes a block table only for blocks that are a multiple of
256), on the CPU small blocks keep the prefix cache fine-grained. Checked on the CPU: the
configuration, and the flash backend's choice of the in-place path for that size."""

from __future__ import annotations

import sys

import numpy as np
import torch

from pyengine.config import EngineConfig
from pyengine.executor.attention import selector
from pyengine.executor.attention.flash import FLASH_PAGED_BLOCK_MULTIPLE, FlashAttentionBackend
from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache


def varlen_with_block_table(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=None,
                            **kwargs):
    raise AssertionError("not called: only the binding is checked")


def bound(block_size: int):
    shape = KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=8, block_size=block_size, dtype=torch.float32)
    cache = PagedKVCache(shape, 2, torch.device("cpu"))
    layout = StepAttentionLayout(
        query_start_loc=np.array([0, 3]), seq_lens=np.array([3]), num_scheduled_tokens=np.array([3]),
        slot_mapping=torch.arange(3), block_tables=torch.zeros(1, 1, dtype=torch.int32), block_size=block_size,
    )
    return FlashAttentionBackend(varlen_with_block_table).bind(cache, layout)


def flash_installed(monkeypatch, installed: bool) -> None:
    """What the selector (and so ``default_block_size``) sees of the flash_attn package."""
    monkeypatch.setattr(selector, "import_flash_varlen", lambda: varlen_with_block_table if installed else None)


def test_cuda_default_lets_flash_attn_read_the_paged_cache_in_place(monkeypatch):
    flash_installed(monkeypatch, True)
    assert ExecutorConfig(device="cuda").block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0
    for config in (EngineConfig(device="cuda"), EngineConfig(device="cuda:1"),
                   EngineConfig(device="cuda", attention_backend="flash_attn", dtype="float16")):
        assert config.block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0
        assert config.scheduler_config(64, 4096).block_size == config.block_size
        assert config.executor_config().block_size == config.block_size
    assert bound(EngineConfig(device="cuda").block_size).paged
    assert not bound(EngineConfig(device="cpu").block_size).paged  # 16 would gather a packed copy on CUDA


def test_where_sdpa_runs_the_default_stays_16(monkeypatch):
    flash_installed(monkeypatch, True)
    assert EngineConfig().block_size == 16 == ExecutorConfig().block_size
    assert EngineConfig(device="cuda", attention_backend="sdpa").block_size == 16
    assert EngineConfig(device="cuda", dtype="float32").block_size == 16  # "auto" picks SDPA for float32
    flash_installed(monkeypatch, False)
    assert EngineConfig(device="cuda").block_size == 16 == ExecutorConfig(device="cuda").block_size
    assert EngineConfig(device="cuda", attention_backend="flash_attn").block_size == 256  # forced: it will run


def test_explicit_sizes_are_kept(monkeypatch):
    flash_installed(monkeypatch, True)
    assert EngineConfig(device="cuda", block_size=32).block_size == 32
    assert EngineConfig(device="cpu", block_size=256).executor_config().block_size == 256


def test_a_flash_attn_that_does_not_import_gets_sdpa_blocks(monkeypatch, tmp_path):
    """Installed but broken (an ABI mismatch): the selector falls back to SDPA, so the
    default block is SDPA's, not flash-attn's 256."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text('raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c10")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert selector.flash_attn_problem(torch.device("cuda"), torch.bfloat16) != ""
    assert EngineConfig(device="cuda").block_size == 16 == ExecutorConfig(device="cuda").block_size
    assert type(selector.select_attention_backend("auto", torch.device("cuda"), torch.bfloat16)).__name__ == "SdpaBackend"
