"""DeepSeek's routing rules against transformers' routers (the same gate weights): the
same experts for every token, with the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from pyengine.models.config import parse_decoder_config
from pyengine.models.deepseek_routing import DeepseekRouter

EXPERTS, HIDDEN = 16, 32
COMMON = dict(hidden_size=HIDDEN, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
              n_routed_experts=EXPERTS, moe_intermediate_size=16, first_k_dense_replace=1, vocab_size=64)
CASES = {
    "v2_greedy": ("DeepseekV2Config", DeepseekV2TopkRouter, dict(topk_method="greedy", num_experts_per_tok=3,
                                                                routed_scaling_factor=1.0)),
    "v2_group_limited": ("DeepseekV2Config", DeepseekV2TopkRouter, dict(
        topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=16.0)),
    "v3_noaux_tc": ("DeepseekV3Config", DeepseekV3TopkRouter, dict(
        n_group=4, topk_group=2, num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "v3_unnormalised": ("DeepseekV3Config", DeepseekV3TopkRouter, dict(
        n_group=2, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.5, norm_topk_prob=False)),
}


def _sorted(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("case", sorted(CASES))
def test_routing_matches_transformers(case):
    config_name, router_class, fields = CASES[case]
    hf_config = getattr(transformers, config_name)(**COMMON, **fields)
    raw = {**hf_config.to_dict(), "architectures": [config_name.replace("Config", "ForCausalLM")]}
    moe = parse_decoder_config(raw).deepseek_moe
    torch.manual_seed(0)
    theirs = router_class(hf_config)
    ours = DeepseekRouter(HIDDEN, moe)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        ours.weight.copy_(theirs.weight)
        if ours.e_score_correction_bias is not None:
            theirs.e_score_correction_bias.normal_(0, 0.3)
            ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
        x = torch.randn(50, HIDDEN)
        _, their_weights, their_ids = theirs(x)
        routing = ours(x)
        our_ids, our_weights = routing.expert_ids, routing.weights
    their_ids, their_weights = _sorted(their_ids, their_weights)
    our_ids, our_weights = _sorted(our_ids, our_weights)
    assert torch.equal(our_ids, their_ids)
    torch.testing.assert_close(our_weights, their_weights.float(), atol=1e-6, rtol=1e-5)
