"""A float checkpoint holding the dequantized weights of a quantized model, for tests: the
reference that transformers runs to check pyengine's quantized products."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.layers import GatedMLP
from pyengine.models.moe import SparseMoeBlock


def dequantized_tensors(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    """Hugging Face name -> float32 tensor of a model (world size 1) quantized at load: the
    packed linears and routed experts dequantized, the rest (norms, MoE routers) as they
    are. Dense, Qwen2/3-MoE and Mixtral layers."""
    tensors: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}"
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = _dense(attn.qkv_proj).split(attn.qkv_proj.local_sizes)
        tensors.update({f"{prefix}.self_attn.q_proj.weight": q, f"{prefix}.self_attn.k_proj.weight": k,
                        f"{prefix}.self_attn.v_proj.weight": v})
        if attn.qkv_proj.bias is not None:
            qb, kb, vb = attn.qkv_proj.bias.detach().split(attn.qkv_proj.local_sizes)
            tensors.update({f"{prefix}.self_attn.q_proj.bias": qb, f"{prefix}.self_attn.k_proj.bias": kb,
                            f"{prefix}.self_attn.v_proj.bias": vb})
        tensors[f"{prefix}.self_attn.o_proj.weight"] = _dense(attn.o_proj)
        if isinstance(mlp, SparseMoeBlock):
            tensors.update(_moe_tensors(mlp, f"{prefix}.{mlp.checkpoint_name}"))
        else:
            tensors.update(_mlp_tensors(mlp, f"{prefix}.mlp"))
        for name, norm in (("input_layernorm", layer.input_layernorm),
                           ("post_attention_layernorm", layer.post_attention_layernorm),
                           ("self_attn.q_norm", attn.q_norm), ("self_attn.k_norm", attn.k_norm)):
            if norm is not None:
                tensors[f"{prefix}.{name}.weight"] = norm.weight.detach()
    tensors["model.norm.weight"] = model.norm.weight.detach()
    if model.quantized_head is None:
        raise ValueError("the model's LM head is not quantized")
    head = model.quantized_head.weight.dequantize()[: model.config.vocab_size]
    tensors["model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"] = head
    if model.lm_head is not None:
        tensors["model.embed_tokens.weight"] = model.embed_tokens.weight.detach()[: model.config.vocab_size]
    return {name: t.float().cpu().contiguous().clone() for name, t in tensors.items()}


def write_dequantized_checkpoint(model: DecoderForCausalLM, source: Path, target: Path) -> Path:
    """``source``'s folder (config, tokenizer) with ``model``'s dequantized weights."""
    return write_reference_checkpoint(source, dequantized_tensors(model), target)


def write_reference_checkpoint(source: Path, tensors: dict[str, torch.Tensor], target: Path) -> Path:
    """``source``'s folder (config, tokenizer; none of its weights) at ``target`` with
    ``tensors`` as its one ``model.safetensors``: most often the float checkpoint that
    transformers runs for a quantized folder whose writer returned the values it stands for."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _mlp_tensors(mlp: GatedMLP, prefix: str) -> dict[str, torch.Tensor]:
    gate, up = _dense(mlp.gate_up_proj).chunk(2)
    return {f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up,
            f"{prefix}.down_proj.weight": _dense(mlp.down_proj)}


def _moe_tensors(block: SparseMoeBlock, prefix: str) -> dict[str, torch.Tensor]:
    """The router as it is (float), every routed expert dequantized under the checkpoint's
    names, and Qwen2-MoE's shared expert and its gate."""
    experts = block.experts
    if experts.quantized is None:
        raise ValueError("the MoE layer's experts are not quantized")
    count = experts.num_experts
    gate_up = experts.quantized.gate_up_weight.dequantize().view(count, 2, -1, experts.hidden_size)
    down = experts.quantized.down_weight.dequantize().view(count, experts.hidden_size, -1)
    gate_name, up_name, down_name = block.expert_names
    tensors = {f"{prefix}.gate.weight": block.gate.weight.detach()}
    for expert in range(count):
        base = f"{prefix}.experts.{expert}"
        tensors.update({f"{base}.{gate_name}.weight": gate_up[expert, 0], f"{base}.{up_name}.weight": gate_up[expert, 1],
                        f"{base}.{down_name}.weight": down[expert]})
    if block.shared_expert is not None and block.shared_expert_gate is not None:
        tensors.update(_mlp_tensors(block.shared_expert, f"{prefix}.shared_expert"))
        tensors[f"{prefix}.shared_expert_gate.weight"] = block.shared_expert_gate.weight.detach()
    return tensors


def _dense(linear: torch.nn.Module) -> torch.Tensor:
    quantized = getattr(linear, "quantized", None)
    if quantized is None:
        raise ValueError(f"{type(linear).__name__} is not quantized")
    return quantized.weight.dequantize()
