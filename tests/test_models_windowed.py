"""Sliding windows, Gemma and Phi-3 against transformers beyond what test_models_parity
covers: the window really changes the result (so the parity tests exercise it), decode far
past the window through the native kernel and the gathered path, Phi-3's long factors, and the config fields as published checkpoints spell them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.executor.attention.sdpa import SdpaBackend
from pyengine.executor.attention.tables import TableAttentionBackend
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.config import parse_decoder_config
from pyengine.models.errors import UnsupportedModelError
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner
from pyengine.testing.transformers_reference import reference_greedy_tokens, reference_model

VOCAB = 512


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def _runner(path, **overrides) -> ModelRunner:
    config = ExecutorConfig(max_num_seqs=4, max_model_len=512, num_kv_blocks=80, **overrides)
    return ModelRunner.from_pretrained(path, config)


def _greedy(runner, prompt, new_tokens, chunk=None) -> list[int]:
    planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=4, scatter_blocks=True,
                          tables=runner.num_kv_tables)
    seq = planner.add(prompt, SamplingParams(temperature=0.0))
    while len(planner.output_tokens(seq)) < new_tokens:
        plan = planner.next_plan(max_chunk=chunk)
        planner.record(plan, runner.execute(plan).sampled_token_ids)
    return planner.output_tokens(seq)[:new_tokens]


@pytest.mark.parametrize("arch", ["mistral_window", "gemma2", "gemma3"])
def test_the_window_changes_the_logits(tmp_path, arch):
    """Without its window the same checkpoint gives other logits past the window: the
    parity tests, which match transformers with the window, do exercise it."""
    windowed = make_tiny_checkpoint(tmp_path / "w", arch, vocab_size=VOCAB)
    unwindowed = make_tiny_checkpoint(tmp_path / "u", arch, vocab_size=VOCAB, sliding_window=4096)
    prompt = torch.tensor([_prompt(1, 60)])
    with torch.no_grad():
        a = reference_model(windowed)(prompt).logits[0]
        b = reference_model(unwindowed)(prompt).logits[0]
    torch.testing.assert_close(a[:20], b[:20], atol=1e-5, rtol=1e-5)  # inside the window: the same
    assert (a[20:] - b[20:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["mistral_window", "qwen2_window", "gemma2", "gemma3"])
@pytest.mark.parametrize("native_decode", [True, False])
def test_decode_far_past_the_window_matches_generate(tmp_path, arch, native_decode):
    """A 100-token prompt in 16-token chunks (across the window's edge), then 60 decodes
    (positions 100..160, eight windows past it), through the native decode kernel's
    window and through the gathered path's shifted tables and masks (what other dtypes
    and CUDA run)."""
    path = make_tiny_checkpoint(tmp_path, arch, vocab_size=VOCAB)
    prompt = _prompt(2, 100)
    runner = _runner(path)
    backend = SdpaBackend(native_decode=native_decode)
    if isinstance(runner.attention_backend, TableAttentionBackend):  # a hybrid model's per-group tables
        runner.attention_backend.inner = backend
    else:
        runner.attention_backend = backend
    ours = _greedy(runner, prompt, 60, chunk=16)
    assert ours == reference_greedy_tokens(path, [prompt], 60)[0]


def test_mixtral_window_on_every_layer_matches_generate(tmp_path):
    """Mixtral's sliding_window (its MoE layers attend as the dense ones do)."""
    path = make_tiny_checkpoint(tmp_path, "mixtral", vocab_size=VOCAB, sliding_window=20)
    prompt = _prompt(4, 50)
    ours = _greedy(_runner(path), prompt, 30, chunk=16)
    assert ours == reference_greedy_tokens(path, [prompt], 30)[0]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("phi3", dict(sliding_window=20)), ("gemma3", dict(max_shard_size="40KB"))],
    ids=["phi3_window_every_layer", "gemma3_sharded"],
)
def test_published_forms_match_generate(tmp_path, arch, overrides):
    """Phi-3-mini-4k's form (a sliding_window on every layer) and a sharded safetensors
    Gemma 3 (an index file and several shards), prompt and decode past the window."""
    path = make_tiny_checkpoint(tmp_path, arch, vocab_size=VOCAB, **overrides)
    if "max_shard_size" in overrides:
        assert (path / "model.safetensors.index.json").is_file()
    prompt = _prompt(5, 45)
    ours = _greedy(_runner(path), prompt, 30, chunk=16)
    assert ours == reference_greedy_tokens(path, [prompt], 30)[0]


def test_phi3_long_prompt_uses_the_long_factors(tmp_path):
    """A prompt past original_max_position_embeddings (128) rotates with the long factors
    (and the attention factor), as transformers does, prefill and decode."""
    path = make_tiny_checkpoint(tmp_path, "phi3", vocab_size=VOCAB)
    prompt = _prompt(3, 150)
    ours = _greedy(_runner(path), prompt, 12)
    assert ours == reference_greedy_tokens(path, [prompt], 12)[0]
    runner = _runner(path)
    rotary = runner.model.rotary
    positions = torch.arange(4)
    short = rotary.cos_sin(positions, torch.float32, torch.full((4,), 100))[0]
    long = rotary.cos_sin(positions, torch.float32, torch.full((4,), 129))[0]
    assert (short - long).abs().max() > 1e-3


BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def test_published_gemma3_fields_are_read():
    """Gemma 3 1B's config.json: no layer_types, rope_local_base_freq, sliding_window_pattern."""
    config = parse_decoder_config(dict(
        BASE, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=6, head_dim=8,
        sliding_window=512, sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
    ))
    assert config.layer_windows == (512, 512, None, 512, 512, None)
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (1_000_000.0, "linear", 8.0)
    assert config.local_rope is not None and (config.local_rope.theta, config.local_rope.rope_type) == (1e4, "default")
    assert config.attention_scale == pytest.approx(256**-0.5)
    assert config.qk_norm and config.attn_logit_softcap is None


def test_qwen2_windows_need_use_sliding_window_and_start_at_max_window_layers():
    raw = dict(BASE, architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, sliding_window=32, max_window_layers=2)
    assert parse_decoder_config(raw).layer_windows == ()  # Qwen2.5's published configs: off
    assert parse_decoder_config(dict(raw, use_sliding_window=True)).layer_windows == (None, None, 32, 32)


def test_mistral_window_applies_to_every_layer_and_null_means_none():
    raw = dict(BASE, architectures=["MistralForCausalLM"], num_hidden_layers=2)
    assert parse_decoder_config(dict(raw, sliding_window=4096)).layer_windows == (4096, 4096)
    assert parse_decoder_config(dict(raw, sliding_window=None)).layer_windows == ()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(architectures=["Qwen2ForCausalLM"], sliding_window=8, use_sliding_window=True,
              layer_types=["full_attention", "chunked_attention"]), "layer_types"),
        (dict(architectures=["MistralForCausalLM"], sliding_window=-1), "sliding_window"),
        (dict(architectures=["Gemma2ForCausalLM"], hidden_activation="relu"), "hidden_activation"),
        (dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True), "use_bidirectional"),
        (dict(architectures=["Phi3ForCausalLM"], rope_scaling={"type": "longrope", "short_factor": [1.0]}),
         "original_max_position_embeddings"),
        (dict(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.75), "partial_rotary_factor"),
        (dict(architectures=["Gemma3ForConditionalGeneration"]), "Gemma3ForConditionalGeneration"),
    ],
)
def test_unsupported_fields_are_named(fields, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_decoder_config(dict(BASE, num_hidden_layers=2, **fields))
