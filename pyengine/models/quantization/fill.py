"""Fill a model from weights that may be packed: the one path the quantized checkpoint
loaders (GGUF files, GPTQ / AWQ folders) share.

Each checkpoint tensor arrives as a float tensor or a :class:`PackedWeight` under its
Hugging Face name. A packed linear weight is cut to this rank's shard along the float
weight's axis (rows for a column-parallel linear, group-aligned input columns for a
row-parallel one), merged with its sibling parts (q/k/v, gate/up) and handed to the linear
(``set_packed_weight``); the LM head likewise (``set_packed_head``; a tied embedding looks
its rows up in it). Float tensors are copied in the engine's dtype.

What costs memory, said here: an untied quantized embedding is dequantized to a float
embedding (vocab x hidden in the engine's dtype; the LM head stays quantized); merged
parts of different layouts (llama.cpp's Q4_K_M mixes Q4_K and Q6_K) are widened to int8
at the finer group, exactly (``merge_parts``); parts with different input permutations
(GPTQ act-order: each projection has its own) or a float part among packed ones make the
whole linear float (dequantized). FP8 checkpoints kept in FP8 (``Fp8Weight``, for
``torch._scaled_mm``) take the same path: cut, merged (all parts FP8) and moved to the
linear's device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Union

import torch

from pyengine.models.checkpoint import check_names_and_shapes
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.layers import WeightTarget, rank_rows
from pyengine.models.quantization.fp8 import Fp8Weight
from pyengine.models.quantization.packed import PackedWeight, QuantizationError

Weight = Union[torch.Tensor, PackedWeight, Fp8Weight]
_QUANTIZED = (PackedWeight, Fp8Weight)


def fill_model(model: DecoderForCausalLM, shapes: dict[str, tuple[int, ...]], read: Callable[[str], Weight]) -> None:
    """Every weight of ``model``: ``shapes`` names the checkpoint's tensors (checked against
    the model all at once), ``read(name)`` gives one in Hugging Face order and layout."""
    targets = model.weight_targets()
    check_names_and_shapes(targets, shapes, model.is_ignorable_checkpoint_tensor)
    linears = _linear_modules(model)
    groups: dict[int, list[tuple[WeightTarget, Weight]]] = defaultdict(list)
    with torch.no_grad():
        model.zero_padding()
        for name, dest in targets.items():
            if not dest.held:  # another rank's expert (expert parallelism)
                continue
            weight = _this_rank(read(name), dest)
            if name in ("lm_head.weight", "model.embed_tokens.weight"):
                _fill_vocab(model, name, dest, weight)
            elif id(dest.parameter) in linears:
                groups[id(dest.parameter)].append((dest, weight))
            else:
                _copy(dest, _as_float(weight))
        for key, parts in groups.items():
            parts.sort(key=lambda part: part[0].row_offset or 0)
            weights = [w for _, w in parts]
            merged = merge_parts(weights)
            if merged is not None:
                linears[key].set_packed_weight(merged.to(parts[0][0].parameter.device))
            else:
                for dest, w in parts:
                    _copy(dest, _as_float(w))


def merge_parts(parts: list[Weight]) -> Union[PackedWeight, Fp8Weight, None]:
    """One quantized weight of the parts' rows in order, or None where they cannot be one
    (a float part, parts of both kinds, different input permutations). Parts of one layout
    are concatenated as they are; mixed integer ones (Q4_K with Q6_K) are first widened to
    int8 at the greatest common group size, with biases (zeros where a part had none):
    exact, at the wider layout's memory."""
    if all(isinstance(p, Fp8Weight) for p in parts):
        fp8 = [p for p in parts if isinstance(p, Fp8Weight)]
        return fp8[0] if len(fp8) == 1 else Fp8Weight.concat_rows(fp8)
    packed = [p for p in parts if isinstance(p, PackedWeight)]
    if len(packed) != len(parts) or not _one_perm(packed):
        return None
    first = packed[0]
    same = all((p.bits, p.group_size, p.biases is None) == (first.bits, first.group_size, first.biases is None)
               for p in packed)
    if same:
        return first if len(packed) == 1 else PackedWeight.concat_rows(packed)
    group = math.gcd(*(p.group_size for p in packed))
    return PackedWeight.concat_rows([_widened(p, group) for p in packed])


def _one_perm(parts: list[PackedWeight]) -> bool:
    first = parts[0].input_perm
    return all(p.input_perm is None if first is None else p.input_perm is not None and torch.equal(p.input_perm, first)
               for p in parts)


def _widened(weight: PackedWeight, group: int) -> PackedWeight:
    """``weight`` as int8 with group ``group`` (a divisor of its own) and biases."""
    repeat = weight.group_size // group
    q = weight.integers().to(torch.int8)
    scales = weight.scales.repeat_interleave(repeat, dim=1)
    biases = torch.zeros_like(scales) if weight.biases is None else weight.biases.repeat_interleave(repeat, dim=1)
    return PackedWeight(bits=8, group_size=group, in_features=weight.in_features, out_features=weight.out_features,
                        qweight=q, scales=scales, biases=biases, input_perm=weight.input_perm)


def _linear_modules(model: torch.nn.Module) -> dict[int, Any]:
    """id(weight parameter) -> the linear holding it, for linears that take packed weights."""
    return {id(m.weight): m for m in model.modules() if hasattr(m, "set_packed_weight") and hasattr(m, "weight")}


def _this_rank(weight: Weight, dest: WeightTarget) -> Weight:
    """The shard of ``weight`` this rank keeps (see ``WeightTarget``)."""
    if dest.parts:  # a fused tensor (Phi-3's qkv_proj): each part's rows of this rank
        if not isinstance(weight, _QUANTIZED):
            return rank_rows(dest, weight)
        merged = merge_parts([weight.rows(start, size) for start, size in dest.kept_rows()])
        assert merged is not None  # rows of one quantized weight
        return merged
    shard = dest.shard
    if dest.shard_dim is None or shard is None or (shard.start == 0 and shard.size == shard.full):
        return weight
    if not isinstance(weight, _QUANTIZED):
        return weight.narrow(dest.shard_dim, shard.start, shard.size)
    if dest.shard_dim == 0:
        return weight.rows(shard.start, shard.size)
    return weight.columns(shard.start, shard.size)


def _fill_vocab(model: DecoderForCausalLM, name: str, dest: WeightTarget, weight: Weight) -> None:
    """The embedding / LM head: a quantized LM head stays quantized (padded with zero rows
    to this rank's vocabulary rows); a quantized untied embedding is dequantized."""
    is_head = name == "lm_head.weight" or model.lm_head is None
    if not isinstance(weight, _QUANTIZED) or not is_head:
        _copy(dest, _as_float(weight))
        return
    extra = model.output_embedding.shape[0] - weight.out_features
    model.set_packed_head(weight.with_zero_rows(extra).to(model.output_embedding.device))


def _as_float(weight: Weight) -> torch.Tensor:
    if isinstance(weight, Fp8Weight):
        return weight.dequantize()
    if not isinstance(weight, PackedWeight):
        return weight
    dense = weight.dequantize()
    if weight.input_perm is None:
        return dense
    # x[..., perm] @ W^T == x @ W_in_order^T with W's column perm[j] = column j.
    return torch.empty_like(dense).index_copy_(1, weight.input_perm, dense)


def _copy(dest: WeightTarget, tensor: torch.Tensor) -> None:
    target = dest.parameter.data
    if dest.row_offset is not None:
        target = target.narrow(0, dest.row_offset, tensor.shape[0])
    if tuple(target.shape) != tuple(tensor.shape):
        raise QuantizationError(f"GGUF tensor of shape {list(tensor.shape)} does not fit {list(target.shape)}")
    target.copy_(tensor)
