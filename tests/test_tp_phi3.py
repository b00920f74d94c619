"""Phi-3 under tensor parallelism: its fused ``qkv_proj`` / ``gate_up_proj`` checkpoint
tensors are cut per part (q by heads, k and v by KV heads or one KV head replicated,
gate and up by intermediate features), and two ranks generate transformers' greedy
tokens, short prompts and one past ``original_max_position_embeddings`` (longrope's long
factors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pyengine import LLM, SamplingParams
from pyengine.models.loader import instantiate_model, load_checkpoint_weights, read_model_config
from pyengine.models.parallel import ParallelContext
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.transformers_reference import reference_greedy_tokens

VOCAB = 512


def _rank_params(path, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    config = read_model_config(path)
    model = instantiate_model(config, torch.float32, torch.device("cpu"), ParallelContext(rank, world_size))
    load_checkpoint_weights(model, path)
    return {name: p.detach() for name, p in model.named_parameters()}


def _split_rows(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(tensor.split(sizes))


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv_split", "kv_replicated"])
def test_each_rank_keeps_its_rows_of_every_fused_part(tmp_path, kv_heads):
    path = make_tiny_checkpoint(tmp_path, "phi3", vocab_size=VOCAB, num_key_value_heads=kv_heads)
    config = read_model_config(path)
    tensors = load_file(str(path / "model.safetensors"))
    dim, heads = config.head_dim, config.num_attention_heads
    q_rows, kv_rows, inter = heads * dim, kv_heads * dim, config.intermediate_size
    ranks = [_rank_params(path, rank, 2) for rank in range(2)]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        q, k, v = _split_rows(tensors[f"{prefix}.self_attn.qkv_proj.weight"], [q_rows, kv_rows, kv_rows])
        gate, up = _split_rows(tensors[f"{prefix}.mlp.gate_up_proj.weight"], [inter, inter])
        for rank, params in enumerate(ranks):
            if kv_heads >= 2:
                k_part, v_part = k.chunk(2)[rank], v.chunk(2)[rank]
            else:  # the one KV head on both ranks
                k_part, v_part = k, v
            expected = torch.cat([q.chunk(2)[rank], k_part, v_part])
            local = params[f"layers.{layer}.self_attn.qkv_proj.weight"]
            torch.testing.assert_close(local, expected, rtol=0, atol=0)
            local = params[f"layers.{layer}.mlp.gate_up_proj.weight"]
            torch.testing.assert_close(local, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]), rtol=0, atol=0)
    whole = _rank_params(path, 0, 1)["layers.0.self_attn.qkv_proj.weight"]
    torch.testing.assert_close(whole, tensors["model.layers.0.self_attn.qkv_proj.weight"], rtol=0, atol=0)


def test_two_ranks_generate_transformers_greedy_tokens_with_longrope(tmp_path):
    """A prompt of 150 tokens (past the 128 of original_max_position_embeddings: the long
    factors and the attention factor) and two short ones, at tensor-parallel size 2."""
    path = make_tiny_checkpoint(tmp_path, "phi3", vocab_size=VOCAB, seed=4)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, 150).tolist(), rng.integers(0, VOCAB, 9).tolist(),
               rng.integers(0, VOCAB, 30).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=256,
             max_model_len=256) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [list(tokens) for tokens in ours] == reference_greedy_tokens(path, prompts, 10)
