"""EAGLE-3 proposals of one step (the scheduler's one-draft learning tries, or k = 1) write
into the rows' own head-cache blocks, no scratch copy (``ScratchBlocks.own_table``): their
drafts are the first drafts of the scratch path's k-step proposals, the scratch blocks are
never touched, and the head's cache over committed positions ends as a run that never
proposed leaves it (its one write is the pair the next step's mirror writes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.eagle3_checkpoint import write_eagle3_head
from pyengine.testing.hand_plan import HandPlanner

VOCAB = 512
K = 3
BLOCK = 16
PROMPTS = [np.random.default_rng(10 + i).integers(0, VOCAB, 9 + 13 * i).tolist() for i in range(3)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = make_tiny_checkpoint(tmp_path_factory.mktemp("target") / "llama", "llama", seed=8, num_hidden_layers=4)
    head = write_eagle3_head(tmp_path_factory.mktemp("head") / "eagle3", target, seed=9, draft_vocab_size=300,
                             aux_layer_ids=(0, 1, 3))
    return target, head


def _runner(folders) -> ModelRunner:
    target, head = folders
    return ModelRunner.from_pretrained(target, ExecutorConfig(
        max_num_seqs=4, max_model_len=256, block_size=BLOCK, num_kv_blocks=64, attention_backend="sdpa",
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": K}))


def _run(runner: ModelRunner, caps) -> list:
    """Eight steps of three greedy sequences (prefills in chunks of 9), every sequence asked
    for ``caps`` drafts (None: the plan names nobody, the mirror still runs), then one
    step asking for none (its mirror writes the pairs the last proposals wrote); each
    step's proposed drafts, per sequence."""
    planner = HandPlanner(num_blocks=64, max_rows=4, block_size=BLOCK)
    for prompt in PROMPTS:
        planner.add(prompt, SamplingParams(temperature=0.0, max_tokens=64))
    proposed = []
    for step in range(9):
        plan = planner.next_plan(max_chunk=9)
        sampled = np.arange(len(plan.sample_rows), dtype=np.int64)
        asks = caps is not None and step < 8
        plan.may_draft_indices = np.arange(len(plan.rows), dtype=np.int64)
        plan.propose_indices = sampled if asks else sampled[:0]
        if asks:
            plan.propose_counts = np.full(len(sampled), caps, dtype=np.int64)
        out = runner.execute(plan)
        planner.record(plan, out.sampled_token_ids)
        if out.next_drafts is not None and int(out.next_drafts[0].sum()):
            counts, tokens = out.next_drafts
            offsets = np.concatenate([[0], np.cumsum(counts)])
            proposed.append([tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(counts))])
    return proposed


def test_one_step_proposals_use_the_rows_own_blocks(folders):
    one, k_steps, never = _runner(folders), _runner(folders), _runner(folders)
    one_drafts = _run(one, 1)
    k_drafts = _run(k_steps, K)
    _run(never, None)
    assert len(one_drafts) == len(k_drafts) > 4
    for step_one, step_k in zip(one_drafts, k_drafts):
        assert [d for d in step_one] == [d[:1] for d in step_k]  # the k-step proposal's first draft
        assert all(len(d) == 1 for d in step_one)
    proposer, quiet = one.proposer, never.proposer
    pool = proposer.scratch.num_blocks
    keys, values = proposer.kv_cache.keys, proposer.kv_cache.values
    assert not keys[:, pool:].any() and not values[:, pool:].any()  # no scratch block written
    assert k_steps.proposer.kv_cache.keys[:, pool:].any()  # (the k-step path does use them)
    # Over every pool block, the head's entries match a run that never proposed: the
    # one-step writes went where the mirror writes the same pair (float32 rounding aside).
    torch.testing.assert_close(keys[:, :pool], quiet.kv_cache.keys[:, :pool], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values[:, :pool], quiet.kv_cache.values[:, :pool], rtol=1e-5, atol=1e-6)
