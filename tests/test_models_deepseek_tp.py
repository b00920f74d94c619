"""DeepSeek (multi-head latent attention, and experts) at tensor-parallel size 2: the
heads split, the latent replicated, every expert split by its intermediate features, and
the engine's greedy tokens are transformers' (one gloo worker process, loopback)."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import LLM, SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.deepseek_checkpoints import DEEPSEEK_MOE, set_correction_bias
from pyengine.testing.transformers_reference import reference_greedy_tokens

MAX_TOKENS = 10


# V2's form (no q_lora_rank, dense); V3 with routed experts from layer 1, a correction
# bias, and a shared expert (each rank a slice of every expert).
VARIANTS = {
    "v2_dense": ("deepseek_v2", {}),
    "v3_moe": ("deepseek_v3", dict(DEEPSEEK_MOE, n_shared_experts=1, routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_ranks_generate_transformers_tokens(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    checkpoint = make_tiny_checkpoint(tmp_path / variant, arch, seed=11, **overrides)
    set_correction_bias(checkpoint)
    rng = np.random.default_rng(4)
    shared = rng.integers(3, 500, 24).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(3, 500, int(rng.integers(2, 30))).tolist() for i in range(8)]
    reference = reference_greedy_tokens(checkpoint, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(checkpoint), tensor_parallel_size=2, max_num_seqs=8, max_model_len=256) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert got == reference
    assert stats.prefix_cache_hit_rate > 0


def test_sizes_that_do_not_split_are_config_errors_naming_them(tmp_path):
    """4 heads and 32 expert features split over 2 ranks, not over 3 (heads) or 64 (features)."""
    import dataclasses

    from pyengine.errors import InvalidConfigError
    from pyengine.models.architectures import check_tensor_parallel
    from pyengine.models.loader import read_model_config

    config = read_model_config(make_tiny_checkpoint(tmp_path / "m", "deepseek_v3", **DEEPSEEK_MOE))
    check_tensor_parallel(config, 2)
    with pytest.raises(InvalidConfigError, match="num_attention_heads"):
        check_tensor_parallel(config, 3)
    moe = dataclasses.replace(config.deepseek_moe, moe_intermediate_size=30)
    with pytest.raises(InvalidConfigError, match="moe_intermediate_size"):
        check_tensor_parallel(dataclasses.replace(config, num_attention_heads=8, deepseek_moe=moe), 4)
