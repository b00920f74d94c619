"""Per-group block tables for hybrid models (full-attention layers beside sliding-window
ones: Gemma 2, Gemma 3, Qwen2 with ``max_window_layers``): the windowed layers' tables
give back the blocks behind the window while a sequence runs, the full layers' table
keeps every block, and greedy tokens stay exactly transformers' through long prompts,
chunked prefill across the window's edge, prefix-cache hits and preemption, at tensor-parallel size 2 and with the executor's
proposers (a draft model, an EAGLE-3 head) too. The pool's usage is read through the
engine's stats."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import LLM, SamplingParams, SchedulerConfig
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.kv_tables import plan_kv_tables, proposer_tables
from pyengine.executor.model_runner import ModelRunner
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.eagle3_checkpoint import write_eagle3_head
from pyengine.testing.transformers_reference import reference_greedy_tokens

BLOCK = 16
WINDOW = 20  # the tiny checkpoints' sliding_window
PROMPT = 40
MAX_TOKENS = 160  # context 200: 13 blocks in a full table

# arch, overrides, tables (full ones first): the windowed tables hold at most 3 blocks
# (the window's 20 tokens span at most 2 blocks of 16, plus the block being filled).
CASES = {
    "gemma2": ("gemma2", {}, 3),  # sliding, full, sliding: 3 tables of 1 layer
    "gemma3": ("gemma3", dict(num_hidden_layers=6, sliding_window_pattern=6), 6),  # 5 local : 1 global
    "qwen2": ("qwen2_window", {}, 2),  # layer 0 full, layer 1 windowed (max_window_layers)
    # 3 full and 7 sliding layers: equal tables would be 10 of one layer, so 4 tables of
    # 3, the last sliding one holding one layer (its blocks have room for 3).
    "gemma3-padded": ("gemma3", dict(num_hidden_layers=10, layer_types=(["sliding_attention"] * 2
                                                                        + ["full_attention"]) * 3
                                                                       + ["sliding_attention"]), 4),
}


# Room for every test's sequences many times over, instead of the 4 GiB CPU default an
# engine without num_kv_blocks sizes its cache to (the file peaked at 11 GB of RSS).
ROOMY_BLOCKS = 512


def _run(path, prompts, max_tokens=MAX_TOKENS, one_by_one=False, **engine_args):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine_args.setdefault("num_kv_blocks", ROOMY_BLOCKS)
    with LLM(str(path), block_size=BLOCK, **engine_args) as llm:
        if one_by_one:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats().scheduler
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], stats


def _prompt(seed, length=PROMPT):
    return np.random.default_rng(seed).integers(3, 500, length).tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def hybrid(request, tmp_path_factory):
    arch, overrides, tables = CASES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides)
    return path, tables


@pytest.mark.parametrize("depth", [1, 2])
def test_windowed_tables_hold_bounded_blocks_and_tokens_match(hybrid, depth):
    path, tables = hybrid
    prompt = _prompt(0)
    tokens, _, stats = _run(path, [prompt], pipeline_depth=depth)
    assert tokens == reference_greedy_tokens(path, [prompt], MAX_TOKENS)
    full = -(-(PROMPT + MAX_TOKENS - 1) // BLOCK)
    # The full table holds every block; each windowed table at most 3 (the 40-token
    # prompt's 3 at first), not the 13 a shared table would hold per table.
    assert full < stats["kv_blocks_used_peak"] <= full + 3 * (tables - 1), stats["kv_blocks_used_peak"]
    assert stats["kv_blocks_freed_behind_window"] >= 10 * (tables - 1)
    assert stats["kv_blocks_used"] == 0


def test_chunked_prefill_across_the_window_edge(hybrid):
    path, _ = hybrid
    prompts = [_prompt(1, 70), _prompt(2, 33)]
    # Chunks of 16 tokens: the window's edge (20) falls inside the second chunk.
    tokens, _, _ = _run(path, prompts, max_tokens=40, max_num_seqs=2, max_num_batched_tokens=16)
    assert tokens == reference_greedy_tokens(path, prompts, 40)


def test_prefix_hits_inside_and_outside_the_window(hybrid):
    path, _ = hybrid
    first = _prompt(4, 90)
    # The same prompt (every block cached, those behind the window freed while the first
    # ran but still findable), one that leaves it after 50 tokens (a hit of 3 blocks whose
    # windowed part starts behind the first's window), and one sharing 10 (no hit).
    prompts = [first, first, first[:50] + _prompt(5, 30), first[:10] + _prompt(6, 30)]
    tokens, cached, stats = _run(path, prompts, max_tokens=30, one_by_one=True)
    assert tokens == reference_greedy_tokens(path, prompts, 30)
    assert cached == [0, 80, 48, 0], cached
    assert stats["kv_blocks_used"] == 0


def test_preemption_recomputes_to_the_same_tokens(hybrid):
    path, tables = hybrid
    prompts = [_prompt(10 + i, 30 + 7 * i) for i in range(4)]
    # Room for about two sequences at a time in every table: the others are preempted.
    tokens, _, stats = _run(path, prompts, max_tokens=60, num_kv_blocks=12 * tables, max_num_seqs=4)
    assert tokens == reference_greedy_tokens(path, prompts, 60)
    assert stats["preemptions"] > 0
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafts_and_forks_keep_every_table_right(hybrid, method):
    path, _ = hybrid
    # A repeating prompt, so prompt lookup drafts (accepted and rejected: the rewinds give
    # back blocks in every table); two greedy samples share the prompt's blocks.
    prompts = [[7, 8, 9, 10, 11] * 9, _prompt(20, 45)]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=2)
    with LLM(str(path), block_size=BLOCK, speculative_config=spec, num_kv_blocks=ROOMY_BLOCKS) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats().scheduler
    want = reference_greedy_tokens(path, prompts, 50)
    for out, tokens in zip(outs, want):
        assert [sample.token_ids for sample in out.outputs] == [tokens, tokens]
    assert stats["spec_draft_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


def test_the_executor_and_the_scheduler_agree_on_the_tables():
    # Gemma 2 at 26 layers: 13 sliding (even) and 13 full (odd), two tables of 13.
    windows = tuple(4096 if i % 2 == 0 else None for i in range(26))
    tables = plan_kv_tables(windows, 26)
    assert tables is not None and tables.layers_per_table == 13
    assert tables.windows == (None, 4096)
    assert tables.table_of_layer == tuple(1 - i % 2 for i in range(26))
    assert tables.cache_index_of_layer == tuple(i // 2 for i in range(26))
    # Qwen2 with max_window_layers 21 of 28: 3 full tables of 7 and a windowed one.
    qwen = plan_kv_tables(tuple(None if i < 21 else 4096 for i in range(28)), 28)
    assert qwen is not None and qwen.windows == (None, None, None, 4096)
    assert qwen.table_of_layer == tuple(min(i // 7, 3) for i in range(28))
    # Gemma 3 4B (34 layers, every sixth full): 5 full, 29 sliding; equal tables would be
    # 34 of one layer, so 7 tables of 5, the last sliding one holding 4.
    gemma3 = plan_kv_tables(tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34)), 34)
    assert gemma3 is not None and gemma3.layers_per_table == 5
    assert gemma3.windows == (None,) + (1024,) * 6
    sliding = [i for i in range(34) if (i + 1) % 6 != 0]
    assert [gemma3.table_of_layer[i] for i in sliding] == [1 + k // 5 for k in range(29)]
    assert [gemma3.cache_index_of_layer[i] for i in sliding] == [k % 5 for k in range(29)]
    # One windowed layer in 28: too many tables, one shared table; no window: none.
    assert plan_kv_tables(tuple(4096 if i == 27 else None for i in range(28)), 28) is None
    assert plan_kv_tables((), 4) is None
    cfg = SchedulerConfig(64, kv_groups=[(20, 2), (None, 1)], group_tables=True)
    assert cfg.group_tables and cfg.table_layout == (1, [None, 20, 20], [1, 0, 0])
    assert SchedulerConfig(64, kv_groups=[(20, 2), (None, 1)]).table_layout is None


def test_a_plan_without_the_tables_slots_is_refused(tmp_path):
    from pyengine.executor.persistent_batch import PlanStateError
    from pyengine.testing.hand_plan import HandPlanner

    path = make_tiny_checkpoint(tmp_path, "gemma2", seed=3)
    runner = ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=2, max_model_len=128, num_kv_blocks=48))
    assert runner.group_tables and runner.num_kv_tables == 3
    assert runner.kv_cache.keys.shape[0] == 1  # one layer per block
    one_table = HandPlanner(block_size=16, num_blocks=48, max_rows=2)
    one_table.add(_prompt(30, 20))
    with pytest.raises(PlanStateError, match="per-group block tables"):
        runner.execute(one_table.next_plan())
    planner = HandPlanner(block_size=16, num_blocks=48, max_rows=2, tables=runner.num_kv_tables)
    planner.add(_prompt(30, 20))
    plan = planner.next_plan()
    assert len(plan.group_slot_mapping) == 2 * 20 and set(plan.block_table_groups.tolist()) == {0, 1, 2}
    assert len(runner.execute(plan).sampled_token_ids) == 1

# ----- whatever the engine's configuration: tensor parallelism, the executor's proposers -----
# The tiny Gemma 2 (sliding, full, sliding: a table of one layer each) at size 2 (the worker
# rank gets each step's per-group tables with the plan and lays its cache out as rank 0),
# with a draft model (its layers read the target's tables) and with an EAGLE-3 head (table
# 0). Context 100: 7
# blocks in the full table, at most 3 in each windowed one.
CONFIG_TOKENS = 60
GEMMA2_TABLES = 3
SMALL = dict(max_num_seqs=2, max_model_len=256)  # a small pool: the default 4 GiB on CPU is not needed


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2", seed=3)


@pytest.fixture(scope="module")
def config_prompts():
    return [_prompt(40, 40), _prompt(41, 53)]


@pytest.fixture(scope="module")
def config_reference(gemma2, config_prompts):
    return reference_greedy_tokens(gemma2, config_prompts, CONFIG_TOKENS)


def _assert_windowed_blocks_freed(stats, prompts):
    """Every sequence's full table holds all its blocks, each windowed one at most 3: the
    peak stays below what one shared table would hold, and blocks came back early."""
    full = sum(-(-(len(p) + CONFIG_TOKENS - 1) // BLOCK) for p in prompts)
    windowed = 3 * (GEMMA2_TABLES - 1) * len(prompts)
    assert full < stats["kv_blocks_used_peak"] <= full + windowed, stats["kv_blocks_used_peak"]
    assert stats["kv_blocks_freed_behind_window"] >= windowed
    assert stats["kv_blocks_used"] == 0


def test_tensor_parallel_ranks_keep_the_per_group_tables(gemma2, config_prompts, config_reference):
    tokens, _, stats = _run(gemma2, config_prompts, max_tokens=CONFIG_TOKENS, tensor_parallel_size=2, **SMALL)
    assert tokens == config_reference
    _assert_windowed_blocks_freed(stats, config_prompts)


def test_tensor_parallel_preemption_and_prefix_hits(gemma2, config_prompts, config_reference):
    # Room for about two sequences at a time in every table (the others are preempted and
    # recomputed), the first prompt twice.
    batch = config_prompts + [config_prompts[0]]
    tokens, _, stats = _run(gemma2, batch, max_tokens=CONFIG_TOKENS, tensor_parallel_size=2, max_num_seqs=3,
                                 max_model_len=256, num_kv_blocks=10 * GEMMA2_TABLES)
    assert tokens == config_reference + config_reference[:1]
    assert stats["preemptions"] > 0
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("draft", ["itself", "qwen3"])
def test_a_draft_model_reads_the_targets_tables(gemma2, config_prompts, config_reference, draft, tmp_path_factory):
    # The target as its own draft (windowed layers, every draft accepted) and a draft
    # with full attention only.
    model = gemma2 if draft == "itself" else make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=5)
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    tokens, _, stats = _run(gemma2, config_prompts, max_tokens=CONFIG_TOKENS, speculative_config=spec, **SMALL)
    assert tokens == config_reference
    assert stats["spec_draft_tokens"] > 0
    if draft == "itself":
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
    _assert_windowed_blocks_freed(stats, config_prompts)


def test_a_draft_model_at_tensor_parallel_size_2(gemma2, config_prompts, config_reference):
    # The draft runs on rank 0 only, over rank 0's tables; the worker rank gets its drafts
    # and the per-group tables with the plan.
    spec = {"method": "draft_model", "model": str(gemma2), "num_speculative_tokens": 3}
    tokens, _, stats = _run(gemma2, config_prompts, max_tokens=CONFIG_TOKENS, speculative_config=spec,
                            tensor_parallel_size=2, **SMALL)
    assert tokens == config_reference
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
    _assert_windowed_blocks_freed(stats, config_prompts)


def test_an_eagle3_head_reads_the_full_table(gemma2, config_prompts, config_reference, tmp_path):
    head = write_eagle3_head(tmp_path / "eagle3", gemma2, seed=2, aux_layer_ids=(0, 1, 2))
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    tokens, _, stats = _run(gemma2, config_prompts, max_tokens=CONFIG_TOKENS, speculative_config=spec, **SMALL)
    assert tokens == config_reference
    assert stats["spec_draft_tokens"] > 0
    _assert_windowed_blocks_freed(stats, config_prompts)


def test_the_scheduler_is_told_the_targets_groups_only(gemma2):
    # The draft's layers read the target's tables and take none of their own: the
    # scheduler's layout is the target's, as the cache's. Gemma 2 as its own draft: each
    # layer reads its own table, so the draft's cache holds one layer per block too.
    spec = {"method": "draft_model", "model": str(gemma2), "num_speculative_tokens": 2}
    runner = ModelRunner.from_pretrained(gemma2, ExecutorConfig(max_num_seqs=2, max_model_len=128, num_kv_blocks=48,
                                                                speculative_config=spec))
    assert runner.group_tables and runner.num_kv_tables == GEMMA2_TABLES
    assert runner.kv_groups == [(20, 2), (None, 1)]
    draft = runner.proposer
    assert draft.tables.table_of_layer == (1, 0, 2) and draft.kv_cache.keys.shape[0] == 1


def test_a_draft_layer_reads_its_windows_table_or_a_full_one():
    # Qwen2 with max_window_layers 21 of 28 (3 full tables of 7, one windowed of 4096).
    target = plan_kv_tables(tuple(None if i < 21 else 4096 for i in range(28)), 28)
    # A full-attention draft of 6 layers spreads over the full tables, 2 each.
    full = proposer_tables(target, (), 6)
    assert full.table_of_layer == (0, 1, 2, 0, 1, 2) and full.cache_index_of_layer == (0, 0, 0, 1, 1, 1)
    assert full.layers_per_table == 2
    # A draft with the target's window on layers 2..3 reads the windowed table there; one
    # with a window the target lacks reads a full table.
    mixed = proposer_tables(target, (None, None, 4096, 4096), 4)
    assert mixed.table_of_layer == (0, 1, 3, 3) and mixed.layers_per_table == 2
    other = proposer_tables(target, (512, 512), 2)
    assert other.table_of_layer == (0, 1) and other.layers_per_table == 1
