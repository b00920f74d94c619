"""DeepSeek-V2 / V3 (multi-head latent attention; dense and with experts) against
transformers on tiny random checkpoints written by transformers itself: logits of a
prefill, and greedy tokens through ``LLM.generate`` with a prefix-cache hit, chunked
prefill and preemption. The KV cache holds one latent row per token and layer, and the
block count says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.latent_kv_cache import LatentKVCacheShape
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.experts import GroupedExperts
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.deepseek_checkpoints import DEEPSEEK_MOE, set_correction_bias
from pyengine.testing.hand_plan import HandPlanner
from pyengine.testing.transformers_reference import reference_greedy_tokens, reference_model

VOCAB = 512
MAX_TOKENS = 12
VARIANTS = {
    "v2_lite_form": ("deepseek_v2", {}),  # no q_lora_rank, mscale != mscale_all_dim
    "v3": ("deepseek_v3", {}),
    "v3_rotate_half": ("deepseek_v3", dict(rope_interleave=False)),
    "v2_moe_group_limited": ("deepseek_v2", dict(
        DEEPSEEK_MOE, n_shared_experts=2, topk_method="group_limited_greedy", routed_scaling_factor=2.0)),
    "v3_moe_noaux_tc": ("deepseek_v3", dict(DEEPSEEK_MOE, n_shared_experts=1, routed_scaling_factor=2.5)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=5, **overrides)
    set_correction_bias(folder)
    return folder


def test_prefill_logits_match_transformers(checkpoint):
    runner = ModelRunner.from_pretrained(checkpoint, ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=32))
    prompt = np.random.default_rng(1).integers(0, VOCAB, 70).tolist()
    planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=8)
    planner.add(prompt)
    out = runner.execute(planner.next_plan(), return_hidden=True)
    ours = runner.model.compute_logits(out.hidden_states)
    with torch.no_grad():
        theirs = reference_model(checkpoint)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(3, VOCAB, 40).tolist()
    return [
        (shared if i % 2 == 0 else []) + rng.integers(3, VOCAB, int(rng.integers(1, 40))).tolist()
        for i in range(16)
    ]


@pytest.fixture(scope="module")
def reference_tokens(checkpoint, prompts):
    return reference_greedy_tokens(checkpoint, prompts, MAX_TOKENS)


def _generate(checkpoint, prompts, **engine_args):
    with LLM(str(checkpoint), max_model_len=256, **engine_args) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats()


def _assert_same(got, reference):
    mismatches = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
    assert not mismatches, f"{len(mismatches)} differ, first {mismatches[0]}: {got[mismatches[0]]} vs {reference[mismatches[0]]}"


def test_greedy_tokens_match_with_a_prefix_cache_hit(checkpoint, prompts, reference_tokens):
    got, stats = _generate(checkpoint, prompts)
    _assert_same(got, reference_tokens)
    assert stats.prefix_cache_hit_rate > 0, "half the prompts share a 40-token prefix"


def test_chunked_prefill_matches(checkpoint, prompts, reference_tokens):
    got, stats = _generate(checkpoint, prompts, max_num_batched_tokens=16, max_num_seqs=8, long_prefill_token_threshold=8)
    assert stats.scheduler["prefill_tokens_scheduled"] > 0
    _assert_same(got, reference_tokens)


def test_tiny_kv_pool_preempts_and_matches(checkpoint, prompts, reference_tokens):
    got, stats = _generate(checkpoint, prompts, num_kv_blocks=10, max_num_seqs=16, enable_prefix_caching=False)
    assert stats.preemptions > 0
    _assert_same(got, reference_tokens)


def test_the_cache_holds_one_latent_row_per_token_and_layer(checkpoint):
    """The block accounting: bytes per block are kv_lora_rank + qk_rope_head_dim values
    per token and layer, and a byte budget buys blocks at that price."""
    budget = 1 << 20
    runner = ModelRunner.from_pretrained(
        checkpoint, ExecutorConfig(max_num_seqs=64, max_model_len=4096, kv_cache_bytes=budget, block_size=16)
    )
    config = runner.loaded.config
    latent = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    assert isinstance(runner.kv_shape, LatentKVCacheShape)
    assert runner.kv_shape.bytes_per_block == config.num_hidden_layers * 16 * latent * 4
    assert runner.num_kv_blocks == budget // runner.kv_shape.bytes_per_block
    assert tuple(runner.kv_cache.latents.shape) == (config.num_hidden_layers, runner.num_kv_blocks, 16, latent)
    # Expanded K and V would take heads * (qk_head_dim + v_head_dim) values per token.
    expanded = config.num_attention_heads * (config.mla.qk_head_dim + config.mla.v_head_dim)
    assert runner.kv_cache.num_bytes * expanded // latent <= budget * expanded // latent


@pytest.fixture(scope="module", params=["v2_lite_form", "v3"])
def dense_checkpoint(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=5, **overrides)


def test_bfloat16_on_cpu_takes_the_gather_path_and_tracks_float32(dense_checkpoint):
    """bfloat16 runs the gather path (no native kernel); fed the float32 run's tokens, its
    logits stay close (its own greedy choices may differ where two logits nearly tie).
    Dense layers only: with experts, a near-tie in routing sends a token elsewhere."""
    checkpoint = dense_checkpoint
    settings = dict(max_num_seqs=4, max_model_len=256, num_kv_blocks=32)
    runner32 = ModelRunner.from_pretrained(checkpoint, ExecutorConfig(dtype="float32", **settings))
    runner16 = ModelRunner.from_pretrained(checkpoint, ExecutorConfig(dtype="bfloat16", **settings))
    assert runner16.kv_cache.latents.dtype == torch.bfloat16
    planner = HandPlanner(block_size=16, num_blocks=runner32.num_kv_blocks, max_rows=4, seed=3, use_placeholders=False)
    rng = np.random.default_rng(0)
    for n in (30, 7, 19):
        planner.add(rng.integers(0, VOCAB, size=n).tolist(), SamplingParams(temperature=0.0))
    for step in range(6):  # prefill chunks, decodes mixed with the last chunk, decodes alone
        plan = planner.next_plan(max_chunk=12)
        out32 = runner32.execute(plan, return_logits=True)
        out16 = runner16.execute(plan, return_logits=True)
        assert torch.allclose(out16.logits.float(), out32.logits, atol=0.15), step
        planner.record(plan, out32.sampled_token_ids)


def test_int8_quantization_leaves_the_up_projections_dense(checkpoint):
    """Online int8 quantizes the linears and the routed experts; kv_b_proj, read per head
    by the absorbed attention, stays dense, and the logits stay near the float model's."""
    settings = dict(max_num_seqs=4, max_model_len=256, num_kv_blocks=32)
    prompt = np.random.default_rng(2).integers(0, VOCAB, 20).tolist()
    logits = []
    for quantization in (None, "int8"):
        runner = ModelRunner.from_pretrained(checkpoint, ExecutorConfig(quantization=quantization, **settings))
        planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=4)
        planner.add(prompt)
        logits.append(runner.execute(planner.next_plan(), return_logits=True).logits)
    attention = runner.model.layers[0].self_attn
    assert attention.o_proj.quantized is not None and attention.kv_b_proj.weight.device.type == "cpu"
    routed = [module for module in runner.model.modules() if isinstance(module, GroupedExperts)]
    assert bool(routed) == (runner.model.config.deepseek_moe is not None)  # the MoE variants have experts
    assert all(experts.quantized is not None for experts in routed)
    assert torch.allclose(logits[0], logits[1], atol=0.1)


def test_a_sharded_checkpoint_with_mtp_layers_loads_as_published(tmp_path):
    """Published V3 is sharded and carries its multi-token-prediction layer after the last
    decoder layer (``model.layers.61`` of 61): the layer is skipped, the rest loads."""
    import json

    from safetensors.torch import save_file

    plain = make_tiny_checkpoint(tmp_path / "plain", "deepseek_v3", seed=5, **DEEPSEEK_MOE)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "deepseek_v3", seed=5, max_shard_size="40KB", **DEEPSEEK_MOE)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    assert len(set(index["weight_map"].values())) > 1
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(64, 128), "model.layers.2.enorm.weight": torch.ones(64)}
    save_file(mtp, sharded / "mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"].update({name: "mtp.safetensors" for name in mtp})
    index_path.write_text(json.dumps(index))
    prompt = np.random.default_rng(3).integers(0, VOCAB, 30).tolist()
    logits = []
    for folder in (plain, sharded):
        runner = ModelRunner.from_pretrained(folder, ExecutorConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=16))
        planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=4)
        planner.add(prompt)
        logits.append(runner.execute(planner.next_plan(), return_logits=True).logits)
    torch.testing.assert_close(logits[1], logits[0])


def test_greedy_tokens_match_transformers_with_every_context_attended_in_slices(dense_checkpoint):
    """Chunked prefill with slices of 8 context rows: fresh chunks and chunks after cached
    context in both forms (20 tokens after 20 expand, 17 or fewer absorb, with the tiny
    sizes), sequences of different contexts in one step, then decodes; the greedy tokens
    are transformers'."""
    from pyengine.executor.attention.mla_sdpa import MlaSdpaBackend

    checkpoint = dense_checkpoint
    runner = ModelRunner.from_pretrained(checkpoint, ExecutorConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=32))
    runner.attention_backend = MlaSdpaBackend(slice_rows=8)
    planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=4, seed=3)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (50, 37, 29)]
    seqs = [planner.add(p, SamplingParams(temperature=0.0)) for p in prompts]
    for chunk in (20, 20, 6, 6, 6, 6, 6, 6, 6, 6):
        plan = planner.next_plan(max_chunk=chunk)
        planner.record(plan, runner.execute(plan).sampled_token_ids)
    model = reference_model(checkpoint)
    for seq, prompt in zip(seqs, prompts):
        got = planner.output_tokens(seq)
        assert len(got) >= 4
        with torch.inference_mode():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=len(got), do_sample=False)[0, len(prompt):]
        assert got == want.tolist()
