"""Sharded model code at tensor-parallel size 2 (two gloo ranks in child processes) gives
the logits of size 1 and of Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from pyengine.errors import InvalidConfigError
from pyengine.models.architectures import check_tensor_parallel
from pyengine.models.loader import read_model_config
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.tp_ranks import generate_on_rank, run_ranks

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
    generate_on_rank(str(checkpoint), str(tmp_path / "tp1.npy"), 0, 1, 0, PROMPTS, STEPS)  # in this process
    run_ranks(checkpoint, tmp_path / "tp2.npy", 2, PROMPTS, STEPS)
    one, two = np.load(tmp_path / "tp1.npy"), np.load(tmp_path / "tp2.npy")
    assert one.shape == two.shape and one.shape[0] >= STEPS
    np.testing.assert_allclose(two, one, atol=2e-5, rtol=1e-5)
    # And the first sampled row (the longer prompt's last position) equals transformers'.
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPTS[1]])).logits[0, -1].numpy()
    np.testing.assert_allclose(two[0], theirs, atol=2e-5, rtol=1e-5)


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
