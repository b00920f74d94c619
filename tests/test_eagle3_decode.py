"""The EAGLE-3 head's native proposal steps (``pyengine.models.eagle3_decode``) against the
modules they stand in for: the same kernels in the same order, so every proposal step's
outputs are bit-identical with the program and without it, and so is every draft; the
tests also show that it ran, and where it must not (steps that are not decode rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.eagle3 import Eagle3Head
from pyengine.models.eagle3_decode import HeadDecodeProgram
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.eagle3_checkpoint import write_eagle3_head
from pyengine.testing.hand_plan import HandPlanner

VOCAB = 512
K = 3
PROMPTS = [np.random.default_rng(i).integers(0, VOCAB, 6 + 11 * i).tolist() for i in range(3)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target") / "qwen3", "qwen3", seed=4, num_hidden_layers=4)


def _proposal_steps(target, head, native: bool, monkeypatch) -> tuple[list, list, list]:
    """Each head step's (output, pre-norm output), each step's drafts, and whether the
    program took each head step, over prefill and decode steps of three sequences."""
    runner = ModelRunner.from_pretrained(target, ExecutorConfig(
        max_num_seqs=4, max_model_len=256, num_kv_blocks=96, attention_backend="sdpa",
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": K}))
    program = runner.proposer.head.decode_program
    assert program is not None  # a float32 head on the CPU qualifies
    if not native:
        runner.proposer.head.decode_program = None
    states, taken = [], []
    original_forward, original_program = Eagle3Head.forward, HeadDecodeProgram.forward

    def recorded(module, *args, **kwargs):
        out, pre = original_forward(module, *args, **kwargs)
        states.append((out.clone(), pre.clone()))
        return out, pre

    def counted(program, *args, **kwargs):
        result = original_program(program, *args, **kwargs)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(Eagle3Head, "forward", recorded)
    monkeypatch.setattr(HeadDecodeProgram, "forward", counted)
    planner = HandPlanner(num_blocks=96, max_rows=4)
    for prompt in PROMPTS:
        planner.add(prompt, SamplingParams(temperature=0.0, max_tokens=64))
    drafts = []
    for _ in range(8):
        plan = planner.next_plan(max_chunk=9)
        out = runner.execute(plan)
        planner.record(plan, out.sampled_token_ids)
        if out.next_drafts is not None:
            drafts.append(out.next_drafts[1].tolist())
    monkeypatch.undo()
    return states, drafts, taken


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_proposal_steps_are_bit_identical_to_the_modules(target, tmp_path, monkeypatch, norm_before_residual):
    head = write_eagle3_head(tmp_path / "head", target, seed=3, draft_vocab_size=200, aux_layer_ids=(0, 1, 3),
                             norm_before_residual=norm_before_residual)
    native_states, native_drafts, taken = _proposal_steps(target, head, True, monkeypatch)
    module_states, module_drafts, untaken = _proposal_steps(target, head, False, monkeypatch)
    assert untaken == []  # the program off: never asked
    assert len(taken) == len(native_states) > 10 and all(taken)
    assert native_drafts == module_drafts and sum(len(d) for d in native_drafts) > 20
    for (out_a, pre_a), (out_b, pre_b) in zip(native_states, module_states, strict=True):
        assert torch.equal(out_a, out_b)
        assert torch.equal(pre_a, pre_b)


def test_steps_that_are_not_decode_rows_run_the_modules(target, tmp_path):
    """A chunk of 12 tokens in one sequence (longer than the chunks the backend expands to
    decode rows) is declined, nothing done; the module path computes it."""
    from pyengine.executor.attention.metadata import StepAttentionLayout
    from pyengine.executor.attention.selector import select_attention_backend
    from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache

    folder = write_eagle3_head(tmp_path / "head", target, seed=5, aux_layer_ids=(0, 1, 3))
    runner = ModelRunner.from_pretrained(target, ExecutorConfig(
        max_num_seqs=2, max_model_len=64, num_kv_blocks=16, attention_backend="sdpa",
        speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": K}))
    head = runner.proposer.head
    layer = head.config.layer
    cache = PagedKVCache(KVCacheShape(num_layers=1, num_kv_heads=head.num_kv_heads, head_dim=layer.head_dim,
                                      block_size=16, dtype=torch.float32), 4, torch.device("cpu"))
    layout = StepAttentionLayout(
        query_start_loc=np.array([0, 12]), seq_lens=np.array([12]), num_scheduled_tokens=np.array([12]),
        slot_mapping=torch.arange(12), block_tables=torch.tensor([[0]], dtype=torch.int32), block_size=16)
    attention = select_attention_backend("sdpa", torch.device("cpu"), torch.float32).bind(cache, layout)
    embeds = torch.randn(12, layer.hidden_size)
    hidden = torch.randn(12, layer.hidden_size)
    assert head.decode_program.forward(embeds, hidden, torch.arange(12), attention) is None
    out, pre = head(embeds, hidden, torch.arange(12), attention)
    assert out.shape == pre.shape == (12, layer.hidden_size) and torch.isfinite(out).all()


@pytest.mark.parametrize("tokens", [3, 100])
def test_the_mirror_projects_keys_and_values_alone_as_the_full_projection_does(target, tmp_path, tokens):
    """``DecoderAttention.project_kv`` (the mirror's: no query rows) against ``project``:
    bit-identical at decode sizes (the same kernel, row by row), within float32 rounding
    over a prompt (another matmul)."""
    folder = write_eagle3_head(tmp_path / "head", target, seed=7, aux_layer_ids=(0, 1, 3))
    runner = ModelRunner.from_pretrained(target, ExecutorConfig(
        max_num_seqs=2, max_model_len=256, num_kv_blocks=16, attention_backend="sdpa",
        speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": K}))
    head = runner.proposer.head
    width = 2 * head.config.layer.hidden_size
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(tokens))
    cos, sin = head.rotary.cos_sin(torch.arange(5, 5 + tokens), torch.float32)
    _, k_full, v_full = head.self_attn.project(x, cos, sin)
    k, v = head.self_attn.project_kv(x, cos, sin)
    assert k.shape == k_full.shape and v.shape == v_full.shape
    if tokens <= 48:
        assert torch.equal(k, k_full) and torch.equal(v, v_full)
    else:
        torch.testing.assert_close(k, k_full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_full, rtol=1e-5, atol=1e-5)
