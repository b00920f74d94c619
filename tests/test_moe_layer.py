"""The MoE layer's parts on their own: routing rules, grouped expert products against a
per-token reference, the fallback loop, weight names and config errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pyengine.models import experts as experts_module
from pyengine.models.errors import UnsupportedModelError
from pyengine.models.experts import GroupedExperts
from pyengine.models.loader import read_model_config
from pyengine.models.parallel import ParallelContext
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


@pytest.mark.parametrize("tokens", [0, 1, 7, 40])
@pytest.mark.parametrize("path", ["grouped", "loop", "packed"])
def test_grouped_experts_equal_a_per_token_loop(tokens, path, monkeypatch):
    experts = _experts()
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=generator)
    routing = softmax_top_k(torch.randn(tokens, E, generator=generator), K, normalize=False)
    expected = _per_token_reference(experts, x, routing.expert_ids, routing.weights)
    if path == "loop":
        monkeypatch.setattr(experts_module, "_grouped_mm_fits", lambda *args: False)
    if path == "packed":
        experts.pack_for_cpu()
        assert experts.gate_up.device.type == "meta"
    torch.testing.assert_close(experts(x, routing), expected, rtol=1e-5, atol=1e-5)


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
