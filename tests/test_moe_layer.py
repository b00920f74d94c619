"""The MoE layer's parts on their own: routing rules, grouped expert products against a
per-token reference (native and torch paths), quantized experts against their dequantized
weights, weight names and config errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from pyengine import _kernels
from pyengine.models import gemv
from pyengine.models.errors import UnsupportedModelError
from pyengine.models.experts import GroupedExperts
from pyengine.models.loader import read_model_config
from pyengine.models.parallel import ParallelContext
from pyengine.models.quantization.apply import quantize_model_experts
from pyengine.models.quantization.packed import QuantizationError
from pyengine.models.router import softmax_top_k
from pyengine.testing.checkpoints import make_tiny_checkpoint

E, H, INTER, K = 6, 16, 8, 2


def _experts(seed: int = 0) -> GroupedExperts:
    experts = GroupedExperts(E, H, INTER, ParallelContext())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up.normal_(generator=generator)
        experts.down.normal_(generator=generator)
    return experts


def _per_token_reference(experts: GroupedExperts, x, ids, weights):
    gate_up = experts.gate_up.view(E, 2 * INTER, H)
    down = experts.down.view(E, H, INTER)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


def test_softmax_top_k_with_and_without_renormalising():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 0.0]])
    raw = softmax_top_k(logits, 2, normalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert raw.expert_ids[0].tolist() == [3, 2] and raw.expert_ids[1, 0] == 0
    torch.testing.assert_close(raw.weights[0], probs[0, [3, 2]])
    normed = softmax_top_k(logits, 2, normalize=True)
    torch.testing.assert_close(normed.weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(normed.weights[0], probs[0, [3, 2]] / probs[0, [3, 2]].sum())


@pytest.mark.parametrize("tokens", [0, 1, 7, 40, 200])
def test_grouped_experts_equal_a_per_token_loop(tokens, monkeypatch):
    """Up to 48 rows an expert's gate/up runs the native kernel (hidden 16), wider blocks
    and the 8-wide down torch.mm; 200 tokens give every expert more than 48 rows."""
    experts = _experts()
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=generator)
    routing = softmax_top_k(torch.randn(tokens, E, generator=generator), K, normalize=False)
    expected = _per_token_reference(experts, x, routing.expert_ids, routing.weights)
    native_rows = []
    gemv_f32 = _kernels.gemv_f32
    monkeypatch.setattr(_kernels, "gemv_f32", lambda out, x, *rest: native_rows.append(len(x)) or gemv_f32(out, x, *rest))
    torch.testing.assert_close(experts(x, routing), expected, rtol=1e-5, atol=1e-5)
    counts = torch.bincount(routing.expert_ids.reshape(-1), minlength=E).tolist()
    assert native_rows == [c for c in counts if 0 < c <= gemv.MAX_ROWS]
    if tokens == 200:
        assert native_rows == []


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [5, 200])
def test_quantized_experts_equal_the_dequantized_float_experts(method, tokens, monkeypatch):
    """quantization= covers the routed experts: their products (native integer kernels on
    decode-sized blocks, dequantize-then-matmul on wider ones) equal float experts holding
    the dequantized weights, and differ from the float experts they were quantized from."""
    experts_count, hidden, inter = 4, 128, 128  # int4 groups of 128 input features
    experts = GroupedExperts(experts_count, hidden, inter, ParallelContext())
    generator = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        experts.gate_up.normal_(generator=generator).mul_(0.1)
        experts.down.normal_(generator=generator).mul_(0.1)
    original = copy.deepcopy(experts)
    quantize_model_experts(experts, method)
    assert experts.gate_up.device.type == "meta" and experts.quantized is not None
    reference = GroupedExperts(experts_count, hidden, inter, ParallelContext())
    with torch.no_grad():
        reference.gate_up.copy_(experts.quantized.gate_up_weight.dequantize())
        reference.down.copy_(experts.quantized.down_weight.dequantize())
    x = torch.randn(tokens, hidden, generator=generator)
    routing = softmax_top_k(torch.randn(tokens, experts_count, generator=generator), K, normalize=True)
    native = []
    gemv_quantized = _kernels.gemv_quantized
    monkeypatch.setattr(_kernels, "gemv_quantized", lambda out, x, *rest: native.append(len(x)) or gemv_quantized(out, x, *rest))
    ours = experts(x, routing)
    assert bool(native) == (tokens == 5)
    torch.testing.assert_close(ours, reference(x, routing), rtol=1e-4, atol=1e-4)
    assert float((ours - original(x, routing).detach()).abs().max()) > 1e-3


def test_int4_experts_split_off_a_group_boundary_are_refused():
    experts = GroupedExperts(2, 128, 128, ParallelContext(rank=1, world_size=2))  # rank 1 starts at feature 64
    with pytest.raises(QuantizationError, match="group size 128"):
        quantize_model_experts(experts, "int4")


def test_experts_left_without_tokens_are_skipped():
    """Every token routed to the same two experts: the other groups are empty."""
    experts = _experts(1)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    logits = torch.full((5, E), -10.0)
    logits[:, 4], logits[:, 1] = 5.0, 4.0
    routing = softmax_top_k(logits, K, normalize=True)
    expected = _per_token_reference(experts, x, routing.expert_ids, routing.weights)
    torch.testing.assert_close(experts(x, routing), expected, rtol=1e-5, atol=1e-5)


def test_weight_targets_name_every_expert_as_published_checkpoints_do():
    experts = GroupedExperts(E, H, INTER, ParallelContext(rank=1, world_size=2))
    qwen = experts.weight_targets("model.layers.0.mlp.experts", ("gate_proj", "up_proj", "down_proj"))
    assert len(qwen) == 3 * E
    up = qwen["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert up.checkpoint_shape == (INTER, H) and up.shard.start == INTER // 2 and up.row_offset == 5 * INTER + INTER // 2
    down = qwen["model.layers.0.mlp.experts.5.down_proj.weight"]
    assert down.checkpoint_shape == (H, INTER) and down.shard_dim == 1 and down.row_offset == 5 * H
    mixtral = experts.weight_targets("model.layers.0.block_sparse_moe.experts", ("w1", "w3", "w2"))
    assert "model.layers.0.block_sparse_moe.experts.0.w3.weight" in mixtral


def _edited_config(tmp_path, arch, **edits):
    folder = make_tiny_checkpoint(tmp_path / arch, arch)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(edits)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(
    "arch, edits, field",
    [
        ("qwen3_moe", dict(num_experts_per_tok=20), "num_experts_per_tok"),
        ("qwen3_moe", dict(moe_intermediate_size=None), "moe_intermediate_size"),
        ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
        ("mixtral", dict(num_local_experts=0), "num_local_experts"),
        ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ],
)
def test_unsupported_moe_fields_are_errors_naming_them(tmp_path, arch, edits, field):
    with pytest.raises(UnsupportedModelError, match=field):
        read_model_config(_edited_config(tmp_path, arch, **edits))


def test_published_config_names_are_read(tmp_path):
    """Published Qwen3-MoE configs say num_experts (transformers 5 writes num_local_experts)."""
    folder = make_tiny_checkpoint(tmp_path / "q", "qwen3_moe")
    raw = json.loads((folder / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    raw["mlp_only_layers"], raw["decoder_sparse_step"] = [], 2
    (folder / "config.json").write_text(json.dumps(raw))
    moe = read_model_config(folder).moe
    assert moe.num_experts == 8 and moe.sparse_layers == (False, True, False)
