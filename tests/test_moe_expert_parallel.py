"""Expert parallelism (``enable_expert_parallel``): at tensor-parallel size 2 each rank
holds half the routed experts whole (instead of half of every expert), runs only the
(token, expert) pairs routed to them, and the block's all-reduce combines the ranks:
the logits and greedy tokens of size 1 and of transformers, float and quantized; an
expert count that does not divide is refused naming it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.errors import InvalidConfigError
from pyengine.models.architectures import check_tensor_parallel
from pyengine.models.experts import GroupedExperts
from pyengine.models.loader import fill_dummy_weights, instantiate_model, read_model_config
from pyengine.models.parallel import ParallelContext
from pyengine.models.quantization.apply import quantize_model_experts
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.deepseek_checkpoints import DEEPSEEK_MOE, set_correction_bias
from pyengine.testing.tp_ranks import check_two_ranks_match_one, check_two_ranks_match_one_and_transformers
from pyengine.testing.transformers_reference import reference_greedy_tokens

PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [8, 9, 10]]
STEPS = 8
# Input widths multiples of int4's group of 128 at both sizes (for the quantized parity).
QUANTIZABLE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64)


def _moe_blocks(config, rank: int, world: int, expert_parallel: bool, method=None):
    model = instantiate_model(config, torch.float32, torch.device("cpu"),
                              ParallelContext(rank, world, expert_parallel=expert_parallel))
    fill_dummy_weights(model, seed=3)
    blocks = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
    if method is not None:
        for block in blocks:
            quantize_model_experts(block.experts, method)
    return blocks


def test_each_rank_holds_its_share_of_the_experts_whole(tmp_path):
    config = read_model_config(make_tiny_checkpoint(tmp_path / "m", "qwen3_moe"))  # 8 experts
    (whole, *_), (r0, *_), (r1, *_) = (_moe_blocks(config, r, w, True) for r, w in ((0, 1), (0, 2), (1, 2)))
    assert (r0.experts.held.start, r0.experts.held.size, r1.experts.held.start) == (0, 4, 4)
    assert r0.experts.part.size == config.moe.expert_intermediate_size  # whole experts, not slices
    torch.testing.assert_close(torch.cat([r0.experts.gate_up, r1.experts.gate_up]), whole.experts.gate_up,
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([r0.experts.down, r1.experts.down]), whole.experts.down, rtol=0, atol=0)
    torch.testing.assert_close(r1.gate.weight, whole.gate.weight, rtol=0, atol=0)  # the router is replicated


@pytest.mark.parametrize("method", [None, "int8", "int4"])
def test_the_ranks_partial_sums_add_up_to_the_whole_layer(tmp_path, method):
    """In one process: each rank's partial output of a routed layer (its experts' pairs,
    the rest zero) sums to the layer at size 1; quantized experts are quantized expert by
    expert, so each rank's packed experts are size 1's, rows for rows."""
    config = read_model_config(make_tiny_checkpoint(tmp_path / "m", "qwen3_moe", **QUANTIZABLE))
    whole, r0, r1 = (_moe_blocks(config, r, w, True, method)[0] for r, w in ((0, 1), (0, 2), (1, 2)))
    if method is not None:
        packed = [b.experts.quantized.gate_up_weight.qweight for b in (whole, r0, r1)]
        torch.testing.assert_close(torch.cat(packed[1:]), packed[0], rtol=0, atol=0)
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = whole(x)
        parts = [block._partial(x) for block in (r0, r1)]
    assert all(part.abs().max() > 0 for part in parts)  # both ranks' experts were routed to
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_two_ranks_give_the_logits_of_one_and_of_transformers(arch, tmp_path):
    """Qwen2-MoE (6 experts, top 3, the shared expert sliced like a dense MLP, a dense
    layer) and Mixtral (4 experts, top 2), through the hand-planned model runner."""
    checkpoint = make_tiny_checkpoint(tmp_path / arch, arch)
    check_two_ranks_match_one_and_transformers(checkpoint, tmp_path, PROMPTS, STEPS, expert_parallel=True)


def test_int4_experts_with_expert_parallelism_give_the_logits_of_one(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen3_moe", **QUANTIZABLE)
    check_two_ranks_match_one(checkpoint, tmp_path, PROMPTS, 6, quantization="int4", expert_parallel=True)


def _greedy(path, **engine) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(greedy tokens, the prompts, the experts rank 0 holds in each routed layer)."""
    rng = np.random.default_rng(4)
    shared = rng.integers(3, 500, 24).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(3, 500, int(rng.integers(2, 30))).tolist() for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(str(path), max_num_seqs=8, max_model_len=256, **engine) as llm:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        held = [m.num_experts for m in llm.engine_core.runner.model.modules() if isinstance(m, GroupedExperts)]
    return tokens, prompts, held


def test_the_engine_with_expert_parallelism_generates_transformers_tokens(tmp_path):
    """DeepSeek-V3 routing (a correction bias, a shared expert) over 8 experts, 4 a rank,
    through ``LLM(tensor_parallel_size=2, enable_expert_parallel=True)``."""
    checkpoint = make_tiny_checkpoint(tmp_path / "v3", "deepseek_v3", seed=11,
                                      **dict(DEEPSEEK_MOE, n_shared_experts=1, routed_scaling_factor=2.5))
    set_correction_bias(checkpoint)
    got, prompts, held = _greedy(checkpoint, tensor_parallel_size=2, enable_expert_parallel=True)
    assert held and all(count == DEEPSEEK_MOE["n_routed_experts"] // 2 for count in held)
    assert got == reference_greedy_tokens(checkpoint, prompts, 10)


def test_an_expert_count_that_does_not_divide_is_refused_naming_it(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen2_moe")  # 6 experts
    config = read_model_config(path)
    check_tensor_parallel(config, 2, expert_parallel=True)
    with pytest.raises(InvalidConfigError, match=r"enable_expert_parallel: the 6 routed experts .* tensor_parallel_size=4"):
        check_tensor_parallel(dataclasses.replace(config, num_attention_heads=8, num_key_value_heads=8,
                                                  head_dim=8), 4, expert_parallel=True)
    odd = make_tiny_checkpoint(tmp_path / "odd", "qwen3_moe", num_experts=5)
    with pytest.raises(InvalidConfigError, match="the 5 routed experts do not split evenly"):
        LLM(str(odd), tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=256)
    # Without expert parallelism every expert is sliced: 5 experts are fine.
    check_tensor_parallel(read_model_config(odd), 2)
