"""Sharded model code at tensor-parallel size 2 (two gloo ranks in child processes) gives
the logits of size 1 and of Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pyengine.errors import InvalidConfigError
from pyengine.models.architectures import check_tensor_parallel
from pyengine.models.loader import read_model_config
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.tp_ranks import check_two_ranks_match_one_and_transformers

# One KV head replicated on both ranks; q/k/v bias with tied embeddings and a vocabulary
# that does not divide (the last rank's slice padded).
# (tests/test_tp_engine.py covers every architecture through the engine.)
VARIANTS = {
    "mistral_one_kv_head": ("mistral", {}),
    "qwen2_bias_tied_odd_vocab": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=509)),
}
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [8, 9, 10]]
STEPS = 8


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def test_two_ranks_give_the_logits_of_one(checkpoint, tmp_path):
    check_two_ranks_match_one_and_transformers(checkpoint, tmp_path, PROMPTS, STEPS)


def test_sizes_that_do_not_divide_are_config_errors_naming_them(tmp_path):
    base = read_model_config(make_tiny_checkpoint(tmp_path / "m", "llama"))  # 4 heads, 2 KV heads, inter 128
    cases = {
        "num_attention_heads": dict(num_attention_heads=6, num_key_value_heads=6, head_dim=16),
        "intermediate_size": dict(intermediate_size=130),
        "num_key_value_heads": dict(num_attention_heads=12, num_key_value_heads=3, head_dim=8),
    }
    for what, fields in cases.items():
        config = dataclasses.replace(base, **fields)
        with pytest.raises(InvalidConfigError, match=what):
            check_tensor_parallel(config, 4)
    check_tensor_parallel(base, 2)  # 4 heads, 2 KV heads, 128: fine


def _shards(config, world_size: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's parameters, dummy-filled (seeded per checkpoint tensor), in this process."""
    from pyengine.models.loader import fill_dummy_weights, instantiate_model
    from pyengine.models.parallel import ParallelContext

    out = []
    for rank in range(world_size):
        model = instantiate_model(config, torch.float32, torch.device("cpu"), ParallelContext(rank, world_size))
        fill_dummy_weights(model, seed=7)
        out.append({name: p.detach() for name, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("variant", ["mistral_one_kv_head", "qwen2_bias_tied_odd_vocab"])
def test_each_rank_holds_its_slice_of_the_same_weights(variant, tmp_path):
    """The shards of 2 ranks put back together are the weights of 1 rank: q/k/v and gate/up
    by output rows (a single KV head on both ranks), o and down by input columns, the
    vocabulary by rows (the last rank's padding zero); also that dummy weights do not
    depend on the tensor-parallel size."""
    arch, overrides = VARIANTS[variant]
    config = read_model_config(make_tiny_checkpoint(tmp_path / variant, arch, **overrides))
    (whole,), (r0, r1) = _shards(config, 1), _shards(config, 2)
    heads, dim, kv = config.num_attention_heads, config.head_dim, config.num_key_value_heads
    q, k = heads * dim, kv * dim
    for layer in range(config.num_hidden_layers):
        prefix = f"layers.{layer}"
        qkv = whole[f"{prefix}.self_attn.qkv_proj.weight"]
        for rank, shard in enumerate((r0, r1)):
            local = shard[f"{prefix}.self_attn.qkv_proj.weight"]
            q_rows = qkv[rank * q // 2 : (rank + 1) * q // 2]
            if kv >= 2:
                k_rows = qkv[q + rank * k // 2 : q + (rank + 1) * k // 2]
                v_rows = qkv[q + k + rank * k // 2 : q + k + (rank + 1) * k // 2]
            else:  # one KV head, replicated
                k_rows, v_rows = qkv[q : q + k], qkv[q + k :]
            torch.testing.assert_close(local, torch.cat([q_rows, k_rows, v_rows]), rtol=0, atol=0)
        o = whole[f"{prefix}.self_attn.o_proj.weight"]
        torch.testing.assert_close(torch.cat([r0[f"{prefix}.self_attn.o_proj.weight"],
                                              r1[f"{prefix}.self_attn.o_proj.weight"]], dim=1), o, rtol=0, atol=0)
        down = whole[f"{prefix}.mlp.down_proj.weight"]
        torch.testing.assert_close(torch.cat([r0[f"{prefix}.mlp.down_proj.weight"],
                                              r1[f"{prefix}.mlp.down_proj.weight"]], dim=1), down, rtol=0, atol=0)
    vocab = config.vocab_size
    embedding = torch.cat([r0["embed_tokens.weight"], r1["embed_tokens.weight"]])
    torch.testing.assert_close(embedding[:vocab], whole["embed_tokens.weight"], rtol=0, atol=0)
    assert not embedding[vocab:].any()
