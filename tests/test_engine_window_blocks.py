"""Sliding windows as block accounting: a model whose every layer is windowed holds a
bounded number of KV blocks however long its context grows (the scheduler frees the
blocks behind the window), and still generates exactly transformers' greedy tokens; a
hybrid model whose layers do not split into few enough equal tables keeps every block. The pool's usage is read
through the engine's stats."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import LLM, InvalidConfigError, SamplingParams, SchedulerConfig
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.transformers_reference import reference_greedy_tokens

BLOCK = 16
PROMPT = 40
MAX_TOKENS = 200  # context 240: 15 blocks, twelve windows of 20 tokens


def _run(path, prompt, **engine_args):
    with LLM(str(path), block_size=BLOCK, **engine_args) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)
        stats = llm.stats().scheduler
    return out[0].outputs[0].token_ids, stats


@pytest.mark.parametrize("arch", ["mistral_window", "qwen2_window_all"])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_windowed_model_holds_bounded_blocks_at_long_context(tmp_path, arch, depth):
    path = make_tiny_checkpoint(tmp_path, arch, seed=3)
    prompt = np.random.default_rng(0).integers(3, 500, PROMPT).tolist()
    tokens, stats = _run(path, prompt, pipeline_depth=depth)
    assert tokens == reference_greedy_tokens(path, [prompt], MAX_TOKENS, ignore_eos=False)[0]
    # A window of 20 tokens spans at most 3 blocks of 16; the 40-token prompt took 3 too.
    assert stats["kv_blocks_used_peak"] <= 4, stats["kv_blocks_used_peak"]
    assert stats["kv_blocks_freed_behind_window"] >= 10
    assert stats["kv_blocks_used"] == 0


def test_a_hybrid_model_with_too_many_tables_keeps_every_block(tmp_path):
    # 8 full layers and 1 windowed: 9 tables of one layer would be more than the 8 the
    # split allows, so the model keeps one shared table (per-group tables, which free the
    # windowed layers' blocks, are tested in test_engine_hybrid_tables.py).
    path = make_tiny_checkpoint(tmp_path, "qwen2_window", seed=3, num_hidden_layers=9, max_window_layers=8)
    prompt = np.random.default_rng(0).integers(3, 500, PROMPT).tolist()
    tokens, stats = _run(path, prompt)
    assert tokens == reference_greedy_tokens(path, [prompt], MAX_TOKENS, ignore_eos=False)[0]
    assert stats["kv_blocks_used_peak"] == -(-(PROMPT + MAX_TOKENS - 1) // BLOCK)
    assert stats["kv_blocks_freed_behind_window"] == 0


def test_scheduler_config_takes_kv_groups():
    cfg = SchedulerConfig(64, kv_groups=[(512, 3), (None, 1)])
    assert cfg.kv_groups == [(512, 3), (None, 1)] and cfg.shared_window is None
    assert "kv_groups=[(512, 3), (None, 1)]" in repr(cfg)
    assert SchedulerConfig(64, kv_groups=[(8, 2), (32, 2)]).shared_window == 32
    assert SchedulerConfig(64).shared_window is None
    with pytest.raises(InvalidConfigError, match="window"):
        SchedulerConfig(64, kv_groups=[(0, 2)])
    with pytest.raises(InvalidConfigError, match="num_layers"):
        SchedulerConfig(64, kv_groups=[(8, 0)])
