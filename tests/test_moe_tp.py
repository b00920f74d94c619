"""Mixture-of-experts under tensor parallelism: at size 2 (two gloo ranks in child
processes) each rank holds a slice of every expert (and of the shared expert), routes
like the others, and the block's one all-reduce gives the logits of size 1 and of
transformers."""

from __future__ import annotations

import pytest
import torch

from pyengine.errors import InvalidConfigError
from pyengine.models.architectures import check_tensor_parallel
from pyengine.models.loader import fill_dummy_weights, instantiate_model, read_model_config
from pyengine.models.parallel import ParallelContext
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.tp_ranks import check_two_ranks_match_one_and_transformers

PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [8, 9, 10]]
STEPS = 8


def test_two_ranks_give_the_logits_of_one_for_qwen2_moe(tmp_path):
    """Qwen2-MoE: routed experts, the gated shared expert and a dense layer, sharded."""
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe")
    check_two_ranks_match_one_and_transformers(checkpoint, tmp_path, PROMPTS, STEPS)


def test_each_rank_holds_a_slice_of_every_expert(tmp_path):
    config = read_model_config(make_tiny_checkpoint(tmp_path / "m", "qwen3_moe"))
    shards = []
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        model = instantiate_model(config, torch.float32, torch.device("cpu"), ParallelContext(rank, world))
        fill_dummy_weights(model, seed=3)
        shards.append(model.layers[0].mlp)
    whole, r0, r1 = shards
    experts, inter, hidden = config.moe.num_experts, config.moe.expert_intermediate_size, config.hidden_size
    gate_up = whole.experts.gate_up.view(experts, 2, inter, hidden)
    local = [r.experts.gate_up.view(experts, 2, inter // 2, hidden) for r in (r0, r1)]
    torch.testing.assert_close(torch.cat(local, dim=2), gate_up, rtol=0, atol=0)
    down = [r.experts.down.view(experts, hidden, inter // 2) for r in (r0, r1)]
    torch.testing.assert_close(torch.cat(down, dim=2), whole.experts.down.view(experts, hidden, inter), rtol=0, atol=0)
    torch.testing.assert_close(r0.gate.weight, whole.gate.weight, rtol=0, atol=0)  # the router is replicated


def test_expert_sizes_that_do_not_divide_are_config_errors_naming_them(tmp_path):
    import dataclasses

    config = read_model_config(make_tiny_checkpoint(tmp_path / "m", "qwen2_moe"))
    odd_experts = dataclasses.replace(config, moe=dataclasses.replace(config.moe, expert_intermediate_size=33))
    with pytest.raises(InvalidConfigError, match="moe_intermediate_size"):
        check_tensor_parallel(odd_experts, 2)
    odd_shared = dataclasses.replace(config, moe=dataclasses.replace(config.moe, shared_expert_intermediate_size=50))
    with pytest.raises(InvalidConfigError, match="shared_expert_intermediate_size"):
        check_tensor_parallel(odd_shared, 4)
    check_tensor_parallel(config, 2)
