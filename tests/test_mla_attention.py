"""Latent attention over the paged latent cache against a naive computation: decode rows
through the native kernel and through the SDPA gather (CUDA's and non-float32 CPU's
path), chunks with and without earlier context, in one step; the expanded form after
cached context, whole and a slice of the context at a time (log-sum-exp merge), and the
memory profile's worst case for it; and the DeepSeek config fields as the published
checkpoints write them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.errors import AttentionBackendUnavailableError
from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.attention.mla_sdpa import MlaStepAttention
from pyengine.executor.attention.selector import select_latent_attention_backend
from pyengine.executor.latent_kv_cache import LatentKVCache, LatentKVCacheShape
from pyengine.models.config import parse_decoder_config
from pyengine.models.errors import UnsupportedModelError
from pyengine.models.rope_yarn import yarn_mscale

HEADS, RANK, ROPE, BLOCK = 4, 16, 8, 4


def _step(seq_lens: list[int], scheduled: list[int], seed: int = 0):
    """A cache with every row's earlier context filled, the step's layout and inputs."""
    rng = torch.Generator().manual_seed(seed)
    dim = RANK + ROPE
    width = max(-(-n // BLOCK) for n in seq_lens)
    cache = LatentKVCache(LatentKVCacheShape(1, dim, RANK, BLOCK, torch.float32), len(seq_lens) * width + 1, torch.device("cpu"))
    permutation = torch.randperm(cache.num_blocks - 1, generator=rng)[: len(seq_lens) * width] + 1
    tables = permutation.view(len(seq_lens), width).to(torch.int32)
    contexts, slots = [], []
    for row, (length, new) in enumerate(zip(seq_lens, scheduled)):
        context = torch.randn(length, dim, generator=rng)
        contexts.append(context)
        positions = torch.arange(length)
        row_slots = tables[row].long()[positions // BLOCK] * BLOCK + positions % BLOCK
        cache.layer_slots(0)[row_slots[: length - new]] = context[: length - new]
        slots.append(row_slots[length - new :])
    starts = np.concatenate([[0], np.cumsum(scheduled)])
    layout = StepAttentionLayout(
        query_start_loc=starts, seq_lens=np.array(seq_lens), num_scheduled_tokens=np.array(scheduled),
        slot_mapping=torch.cat(slots), block_tables=tables, block_size=BLOCK,
    )
    q = torch.randn(int(starts[-1]), HEADS, dim, generator=rng)
    latent = torch.cat([c[len(c) - n :] for c, n in zip(contexts, scheduled)])
    return cache, layout, q, latent, contexts


def _naive(q, contexts, scheduled, scale):
    out, start = [], 0
    for context, new in zip(contexts, scheduled):
        for i in range(new):
            visible = context[: len(context) - new + i + 1]
            probs = torch.softmax(q[start + i] @ visible.T * scale, dim=-1)
            out.append(probs @ visible[:, :RANK])
        start += new
    return torch.stack(out)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("slice_rows", [1024, 4, 5, 3, 1])
def test_decodes_and_absorbed_chunks_match_a_naive_computation(native, slice_rows):
    """Absorbed chunks with their context whole (1024) and in slices of a block (4), not of
    a block (5), smaller than one (3) and of one row; chunks after 10 and 20 cached rows
    (ending inside blocks) next to decodes and a fresh prompt; sliced equals whole."""
    seq_lens, scheduled = [9, 1, 14, 6, 5, 23], [1, 1, 4, 6, 1, 3]
    cache, layout, q, latent, contexts = _step(seq_lens, scheduled)
    step = MlaStepAttention(cache, layout, native=native, slice_rows=slice_rows)  # False: CUDA's gather path
    out = step.attend_latent(0, q, latent, 0.3)
    torch.testing.assert_close(out, _naive(q, contexts, scheduled, 0.3), atol=1e-5, rtol=1e-5)
    whole = MlaStepAttention(cache, layout, native=native).attend_latent(0, q, latent, 0.3)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)


def test_an_absorbed_chunk_after_a_long_context_scores_a_slice_at_a_time(monkeypatch):
    """The absorbed form never scores more than a slice of context rows at once."""
    from pyengine.executor.attention import sliced

    seq_lens, scheduled = [41], [3]
    cache, layout, q, latent, contexts = _step(seq_lens, scheduled, seed=2)
    scored = []
    real = sliced._partial

    def counting(q, keys, values, mask, scale, softcap):
        scored.append(keys.shape[-2])
        return real(q, keys, values, mask, scale, softcap)

    monkeypatch.setattr(sliced, "_partial", counting)
    out = MlaStepAttention(cache, layout, slice_rows=8).attend_latent(0, q, latent, 0.3)
    torch.testing.assert_close(out, _naive(q, contexts, scheduled, 0.3), atol=1e-5, rtol=1e-5)
    assert scored == [8, 8, 8, 8, 8, 1]


def test_flash_attn_is_refused_for_latent_attention():
    with pytest.raises(AttentionBackendUnavailableError, match="latent attention"):
        select_latent_attention_backend("flash_attn")
    assert select_latent_attention_backend("auto").name == "mla_sdpa"


# The published DeepSeek-V3 config.json's fields (bf16 conversion: no quantization_config).
V3_PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def test_the_published_v3_config_parses():
    config = parse_decoder_config(V3_PUBLISHED)
    mla, moe = config.mla, config.deepseek_moe
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.latent_dim, mla.q_lora_rank) == (512, 64, 576, 1536)
    assert config.head_dim == 64 and config.rope.rope_type == "yarn" and config.rope.factor == 40
    assert mla.softmax_scale == pytest.approx(192**-0.5 * yarn_mscale(40, 1.0) ** 2)
    assert (moe.scoring_func, moe.topk_method, moe.n_group, moe.topk_group) == ("sigmoid", "noaux_tc", 8, 4)
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    # Expanded K/V would hold 128 heads x (192 + 128) values per token; the latent holds 576.
    assert 128 * (192 + 128) / mla.latent_dim == pytest.approx(71.1, abs=0.1)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
        (dict(topk_method="greedy"), "topk_method"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(n_group=7), "n_group"),
    ],
)
def test_unsupported_deepseek_fields_are_refused_naming_them(changes, field):
    with pytest.raises(UnsupportedModelError, match=field):
        parse_decoder_config({**V3_PUBLISHED, **changes})


NOPE, VALUE = 8, 8


def _queries(tokens: int, seed: int = 1):
    from pyengine.models.mla import LatentQueries

    rng = torch.Generator().manual_seed(seed)
    return LatentQueries(torch.randn(tokens, HEADS, NOPE, generator=rng), torch.randn(tokens, HEADS, ROPE, generator=rng),
                         torch.randn(HEADS, NOPE, RANK, generator=rng) * 0.3,
                         torch.randn(HEADS, VALUE, RANK, generator=rng) * 0.3)


def _naive_expanded(queries, contexts, scheduled, scale):
    """Every head's keys [W_UK c, k_rope] and values W_UV c, attended token by token."""
    out, start = [], 0
    for context, new in zip(contexts, scheduled):
        for i in range(new):
            visible = context[: len(context) - new + i + 1]
            token = start + i
            heads = []
            for h in range(HEADS):
                keys = torch.cat([visible[:, :RANK] @ queries.w_uk[h].T, visible[:, RANK:]], dim=-1)
                query = torch.cat([queries.nope[token, h], queries.rope[token, h]])
                probs = torch.softmax(keys @ query * scale, dim=-1)
                heads.append(probs @ (visible[:, :RANK] @ queries.w_uv[h].T))
            out.append(torch.stack(heads))
        start += new
    return torch.stack(out)


@pytest.mark.parametrize("native", [True, False])
def test_attend_mla_expands_long_prompt_chunks_and_absorbs_the_rest_alike(native):
    """Decodes, a short chunk after a long context (absorbed) and fresh prompts (expanded:
    ``expands``) in one step give the naive per-head attention, as does the absorbed form
    for everything."""
    from pyengine.executor.attention.mla_sdpa import expands

    seq_lens, scheduled = [9, 14, 6, 5, 12], [1, 4, 6, 1, 12]
    cache, layout, _, latent, contexts = _step(seq_lens, scheduled)
    queries = _queries(int(sum(scheduled)))
    expected = _naive_expanded(queries, contexts, scheduled, 0.3)
    step = MlaStepAttention(cache, layout, native=native)
    torch.testing.assert_close(step.attend_mla(0, queries, latent, 0.3), expected, atol=1e-5, rtol=1e-5)
    forms = [expands(chunk, queries) for chunk in step.chunks]
    assert forms == [False, True, True]  # the 4 tokens after 10 cached rows stay absorbed
    absorbed_only = MlaStepAttention(cache, layout, native=native, expand_prefill=False)
    torch.testing.assert_close(absorbed_only.attend_mla(0, queries, latent, 0.3), expected, atol=1e-5, rtol=1e-5)
    prompts_only = _step([7, 5], [7, 5], seed=3)  # every token in an expanded chunk
    cache, layout, _, latent, contexts = prompts_only
    queries = _queries(12, seed=4)
    out = MlaStepAttention(cache, layout, native=native).attend_mla(0, queries, latent, 0.3)
    torch.testing.assert_close(out, _naive_expanded(queries, contexts, [7, 5], 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("slice_rows", [1024, 4, 5, 3])
def test_expanded_chunks_after_cached_context_in_slices_match_the_naive_attention(native, slice_rows):
    """A chunk after cached context that expands, whole (1024) and with its context in
    slices of a block (4), not of a block (5: slices start inside blocks) and smaller than a
    block (3); next to a fresh prompt (sliced too), decodes and a short absorbed chunk."""
    from pyengine.executor.attention.mla_sdpa import expands

    seq_lens, scheduled = [9, 30, 14, 13, 27], [1, 20, 4, 13, 1]  # 20 tokens after 10 cached rows
    cache, layout, _, latent, contexts = _step(seq_lens, scheduled, seed=5)
    queries = _queries(int(sum(scheduled)), seed=6)
    step = MlaStepAttention(cache, layout, native=native, slice_rows=slice_rows)
    out = step.attend_mla(0, queries, latent, 0.3)
    assert [expands(chunk, queries) for chunk in step.chunks] == [True, False, True]
    assert step.chunks[0].block_ids is not None  # the expanded chunk reads its context from the cache
    torch.testing.assert_close(out, _naive_expanded(queries, contexts, scheduled, 0.3), atol=1e-5, rtol=1e-5)


def test_a_long_context_is_expanded_a_slice_at_a_time():
    """The expansion never holds more than a slice of rows, whatever the context."""
    from pyengine.models.mla import LatentQueries

    seq_lens, scheduled = [41], [17]
    cache, layout, _, latent, contexts = _step(seq_lens, scheduled, seed=7)
    queries = _queries(17, seed=8)
    expanded_rows = []

    class Counting(LatentQueries):
        def keys_values(self, rows):
            expanded_rows.append(rows.shape[0])
            return super().keys_values(rows)

    counting = Counting(queries.nope, queries.rope, queries.w_uk, queries.w_uv)
    out = MlaStepAttention(cache, layout, slice_rows=8).attend_mla(0, counting, latent, 0.3)
    torch.testing.assert_close(out, _naive_expanded(queries, contexts, scheduled, 0.3), atol=1e-5, rtol=1e-5)
    assert expanded_rows == [8, 8, 8, 8, 8, 1]


def test_the_memory_profile_s_steps_and_slice_size_checks():
    """After one full slice of context: a full chunk, and when that expands, the longest
    chunk that stays absorbed after any context that fits (the longer the context, the
    longer that chunk), attended absorbed."""
    from pyengine.errors import InvalidConfigError
    from pyengine.executor.attention.mla_sdpa import MlaSdpaBackend, expansion_costs_less
    from pyengine.models.config import parse_decoder_config

    config = parse_decoder_config(V3_PUBLISHED)
    sizes = (128, 64, 128, 512)

    def steps(backend, tokens, max_model_len):
        return [(t, c, b.expand_prefill) for t, c, b in backend.profile_steps(tokens, max_model_len, config)]

    backend = MlaSdpaBackend(slice_rows=1024)
    assert steps(backend, 8192, 163840) == [(8192, 1024, True), (170, 1024, False)]
    assert not expansion_costs_less(170, 163840, *sizes) and expansion_costs_less(171, 163840, *sizes)
    assert expansion_costs_less(170, 1194, *sizes)  # after one slice, 170 tokens would expand
    assert steps(backend, 8192, 8500) == [(8192, 308, True), (167, 1024, False)]  # as far as max_model_len lets it
    assert steps(backend, 128, 4096) == [(128, 1024, True)]  # absorbed itself: one step covers it
    assert steps(MlaSdpaBackend(expand_prefill=False), 8192, 163840) == [(8192, 1024, False)]
    assert steps(backend, 256, 256) == []  # no context ever before a full chunk
    with pytest.raises(InvalidConfigError, match="slice_rows"):
        MlaSdpaBackend(slice_rows=0)


def test_the_memory_profile_runs_each_form_s_largest_chunk_after_a_slice_of_context(tmp_path):
    """Besides a fresh prompt of max_num_batched_tokens, the profile runs that chunk after
    a full slice of cached rows (expanded) and the longest chunk that stays absorbed,
    absorbed: the most either form holds at once."""
    from pyengine.executor.attention.mla_sdpa import MlaSdpaBackend, expansion_costs_less
    from pyengine.executor.config import ExecutorConfig
    from pyengine.executor.model_runner import ModelRunner
    from pyengine.testing.checkpoints import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "mla", "deepseek_v2")
    runner = ModelRunner.from_pretrained(folder, ExecutorConfig(
        dtype="float32", max_num_seqs=2, max_model_len=128, block_size=4, num_kv_blocks=64, max_num_batched_tokens=32,
    ))
    steps = []

    class Recording(MlaSdpaBackend):
        def bind(self, cache, layout):
            steps.append((layout.seq_lens.tolist(), layout.num_scheduled_tokens.tolist(), self.expand_prefill))
            return super().bind(cache, layout)

    runner.attention_backend = Recording(slice_rows=16)
    runner._profile_forward()
    mla = runner.loaded.config.mla
    sizes = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank)
    absorbed = max(t for t in range(2, 33) if not expansion_costs_less(t, 128, *sizes))
    assert expansion_costs_less(32, 48, *sizes) and 1 < absorbed < 32
    assert steps == [([48], [32], True), ([absorbed + 16], [absorbed], False), ([32], [32], True)]
