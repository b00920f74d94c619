"""oneDNN-packed CPU linears: same values as F.linear, dense weights released, no-op off float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyengine.models import cpu_linear
from pyengine.models.loader import load_model
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.contiguous_reference import ContiguousKVCache, contiguous_step

pytestmark = pytest.mark.skipif(
    not cpu_linear.can_pack(torch.ones(1)), reason="this PyTorch build has no oneDNN"
)


@pytest.mark.parametrize("rows", [0, 1, 37, 300])
def test_packed_matmuls_equal_dense(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    other_weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(40, rows, generator=gen).T  # not contiguous, as attention outputs often are
    packed, other_packed = cpu_linear.pack(weight), cpu_linear.pack(other_weight)
    torch.testing.assert_close(cpu_linear.linear(x, packed), F.linear(x, weight))
    torch.testing.assert_close(cpu_linear.linear(x, packed, bias), F.linear(x, weight, bias))
    gate = cpu_linear.linear_silu(x, packed)
    torch.testing.assert_close(gate, F.silu(F.linear(x, weight)))
    torch.testing.assert_close(
        cpu_linear.linear_times(x, other_packed, gate), F.linear(x, other_weight) * F.silu(F.linear(x, weight))
    )


@pytest.mark.parametrize(
    "arch, overrides",
    [("qwen3", dict(tie_word_embeddings=True)), ("qwen2", {}), ("llama", {})],
    ids=["qwen3_tied", "qwen2_bias", "llama_untied"],
)
def test_packed_model_matches_dense_and_releases_weights(tmp_path, arch, overrides):
    folder = make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    dense, packed = load_model(folder).model, load_model(folder).model
    layer = packed.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    shapes = [linear.weight.shape for linear in linears]
    packed.pack_for_cpu()
    packed.pack_for_cpu()  # a second call changes nothing
    for linear in linears:
        linear.pack_for_cpu()
    assert [linear.weight.shape for linear in linears] == shapes
    assert all(linear.weight.is_meta for linear in linears)  # the dense copies are freed
    assert packed.packed_head is not None
    assert not packed.embed_tokens.weight.is_meta  # the input embedding stays dense
    if packed.lm_head is not None:
        assert packed.lm_head.weight.is_meta
    tokens = torch.randint(0, 512, (3, 45), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, model in (("dense", dense), ("packed", packed)):
        cache = ContiguousKVCache(model, 3, 64)
        prefill = contiguous_step(model, cache, tokens)
        decode = contiguous_step(model, cache, prefill.argmax(-1, keepdim=True))
        logits[name] = (prefill, decode)
    for got, want in zip(logits["packed"], logits["dense"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_pack_is_a_no_op_for_bfloat16(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path / "m", "qwen3"), dtype="bfloat16").model
    model.pack_for_cpu()
    assert model.packed_head is None
    assert model.layers[0].mlp.packed_gate_up is None
    assert not model.layers[0].self_attn.qkv_proj.weight.is_meta
