"""The default KV block size per device: on CUDA flash-attn must read the paged cache in
place (upstream flash-attn takes a block table only for blocks that are a multiple of
256), on the CPU small blocks keep the prefix cache fine-grained. The configuration is
plain data (``block_size=None`` stays None and probes nothing); the runner decides the
size when it starts. Checked on the CPU: the rule, that building a configuration never
asks about flash-attn, and the flash backend's choice of the in-place path for that size."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pyengine.config import EngineConfig
from pyengine.executor.attention import selector
from pyengine.executor.attention.flash import FLASH_PAGED_BLOCK_MULTIPLE, FlashAttentionBackend
from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.attention.selector import default_block_size, resolve_block_size
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache

PACKAGE = Path(__file__).resolve().parents[1] / "pyengine"


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


def block_size(**settings) -> int:
    """The block size a runner started with these engine arguments uses."""
    return resolve_block_size(EngineConfig(**settings).executor_config()).block_size


def test_building_a_configuration_never_asks_about_flash_attn(monkeypatch):
    def probe():
        raise AssertionError("a configuration probed flash-attn")

    monkeypatch.setattr(selector, "import_flash_varlen", probe)
    for settings in ({"device": "cuda"}, {"device": "cuda:1", "dtype": "float16"}, {"device": "cpu"}):
        config = EngineConfig(**settings)
        assert config.block_size is None and config.executor_config().block_size is None
        assert ExecutorConfig(**settings).block_size is None
    with pytest.raises(AssertionError, match="probed"):  # the runner's resolution does ask
        block_size(device="cuda")


def test_the_configurations_import_neither_torch_nor_the_selector():
    """Statically, lazy imports included: configuration is plain data."""
    for rel in ("config.py", "executor/config.py", "models/dtypes.py"):
        tree = ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        wrong = {name for name in imported if name.split(".")[0] == "torch" or "attention" in name}
        assert not wrong, f"{rel} imports {sorted(wrong)}"


def test_cuda_default_lets_flash_attn_read_the_paged_cache_in_place(monkeypatch):
    flash_installed(monkeypatch, True)
    assert resolve_block_size(ExecutorConfig(device="cuda")).block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0
    for settings in ({"device": "cuda"}, {"device": "cuda:1"},
                     {"device": "cuda", "attention_backend": "flash_attn", "dtype": "float16"}):
        assert block_size(**settings) % FLASH_PAGED_BLOCK_MULTIPLE == 0
        config = EngineConfig(**settings)
        assert config.scheduler_config(64, block_size(**settings), 4096).block_size == block_size(**settings)
    assert bound(block_size(device="cuda")).paged
    assert not bound(block_size(device="cpu")).paged  # 16 would gather a packed copy on CUDA


def test_where_sdpa_runs_the_default_stays_16(monkeypatch):
    flash_installed(monkeypatch, True)
    assert block_size() == 16 == resolve_block_size(ExecutorConfig()).block_size
    assert block_size(device="cuda", attention_backend="sdpa") == 16
    assert block_size(device="cuda", dtype="float32") == 16  # "auto" picks SDPA for float32
    flash_installed(monkeypatch, False)
    assert block_size(device="cuda") == 16 == default_block_size("cuda")
    assert block_size(device="cuda", attention_backend="flash_attn") == 256  # forced: it will run


def test_explicit_sizes_are_kept(monkeypatch):
    flash_installed(monkeypatch, True)
    assert block_size(device="cuda", block_size=32) == 32
    assert EngineConfig(device="cpu", block_size=256).executor_config().block_size == 256
    assert block_size(device="cpu", block_size=256) == 256


def test_the_engine_reports_the_size_its_runner_chose(tmp_path):
    """A real runner on the CPU: None becomes 16 in the runner, the engine core and the
    scheduler's pool (a request of 17 tokens spans two blocks)."""
    from pyengine import LLM, SamplingParams

    with LLM(num_kv_blocks=8, max_num_seqs=2, max_num_batched_tokens=64) as llm:
        assert llm.engine_core.config.block_size is None
        assert llm.engine_core.block_size == llm.engine_core.runner.block_size == 16
        assert llm.engine_core.max_request_tokens == 8 * 16
        out = llm.generate([list(range(3, 20))], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2


def test_a_flash_attn_that_does_not_import_gets_sdpa_blocks(monkeypatch, tmp_path):
    """Installed but broken (an ABI mismatch): the selector falls back to SDPA, so the
    default block is SDPA's, not flash-attn's 256."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text('raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c10")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert selector.flash_attn_problem(torch.device("cuda"), torch.bfloat16) != ""
    assert block_size(device="cuda") == 16 == resolve_block_size(ExecutorConfig(device="cuda")).block_size
    assert type(selector.select_attention_backend("auto", torch.device("cuda"), torch.bfloat16)).__name__ == "SdpaBackend"
