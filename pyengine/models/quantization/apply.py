"""Quantize a loaded float model in place (``load_model(..., quantization=...)``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pyengine.models.experts import GroupedExperts
from pyengine.models.layers import ColumnParallelLinear, RowParallelLinear
from pyengine.models.quantization.kernels import prepare_weight
from pyengine.models.quantization.online import INT4_GROUP_SIZE, METHODS, quantize_weight
from pyengine.models.quantization.packed import PackedWeight, QuantizationError

if TYPE_CHECKING:
    from pyengine.models.decoder import DecoderForCausalLM


def quantize_model(model: "DecoderForCausalLM", method: str, kernel: str = "native") -> None:
    """Every linear of the decoder layers, the routed experts of MoE layers (expert by
    expert, stacked again) and the LM head (a tied embedding shares the head's
    packed weight) replaced by its ``method`` weight in ``kernel``'s layout
    (``kernels.choose_kernel``), one at a time, so the peak memory is the float model plus
    one float32 copy of the largest weight. The routers stay float: they choose the
    experts. A tied head under ``int4pack`` is int8 (``int8pack``): tinygemm's layout
    cannot look embedding rows up."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RowParallelLinear):
                _check_row_shard(module, method)
                module.set_packed_weight(prepare_weight(quantize_weight(module.weight, method), kernel,
                                                        module.weight.dtype))
            elif isinstance(module, ColumnParallelLinear):
                module.set_packed_weight(prepare_weight(quantize_weight(module.weight, method), kernel,
                                                        module.weight.dtype))
            elif isinstance(module, GroupedExperts):
                if kernel != "native":
                    raise QuantizationError(
                        f"quantization={method!r} with kernel {kernel!r}: mixture-of-experts layers are "
                        "quantized for the native CPU kernels only yet"
                    )
                quantize_model_experts(module, method)
        head_method, head_kernel = method, kernel
        if kernel == "int4pack" and model.lm_head is None:
            head_method, head_kernel = "int8", "int8pack"
        head = model.output_embedding
        model.set_packed_head(prepare_weight(quantize_weight(head, head_method), head_kernel, head.dtype))


def quantize_model_experts(experts: GroupedExperts, method: str) -> None:
    """One MoE layer's routed experts replaced by ``method`` PackedWeights."""
    with torch.no_grad():
        _check_shard_start(experts.part.start, method)
        experts.set_packed_weights(_per_expert(experts.gate_up, experts.num_experts, method),
                                   _per_expert(experts.down, experts.num_experts, method))


def _per_expert(stacked: torch.Tensor, num_experts: int, method: str) -> PackedWeight:
    """A stacked expert parameter ([E * rows, in]) quantized one expert at a time (the
    peak stays one expert's float32 temporaries), the parts stacked again."""
    blocks = stacked.view(num_experts, -1, stacked.shape[1])
    parts = [quantize_weight(block, method) for block in blocks]
    packed = [p for p in parts if isinstance(p, PackedWeight)]
    if len(packed) != len(parts):
        raise QuantizationError(f"quantization={method!r}: routed experts take integer methods only yet (int8, int4)")
    return PackedWeight.concat_rows(packed)


def _check_row_shard(linear: RowParallelLinear, method: str) -> None:
    """A row-parallel shard's groups must be the whole weight's groups (start on a boundary)."""
    _check_shard_start(linear.input_shard.start, method)


def _check_shard_start(start: int, method: str) -> None:
    if method != "int4" or start % INT4_GROUP_SIZE == 0:
        return
    raise QuantizationError(
        f"quantization='int4' ({METHODS['int4']}): this rank's input features start at "
        f"{start}, not a multiple of the group size {INT4_GROUP_SIZE}; "
        "choose a tensor_parallel_size that splits the layer on group boundaries"
    )
