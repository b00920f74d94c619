"""Quantize a loaded float model in place (``load_model(..., quantization=...)``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pyengine.models.layers import ColumnParallelLinear, RowParallelLinear
from pyengine.models.quantization.online import INT4_GROUP_SIZE, METHODS, quantize_weight
from pyengine.models.quantization.packed import QuantizationError

if TYPE_CHECKING:
    from pyengine.models.decoder import DecoderForCausalLM


def quantize_model(model: "DecoderForCausalLM", method: str) -> None:
    """Every linear of the decoder layers and the LM head (a tied embedding shares the
    head's packed weight) replaced by its ``method`` PackedWeight, one at a time, so the
    peak memory is the float model plus one float32 copy of the largest weight."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RowParallelLinear):
                _check_row_shard(module, method)
                module.set_packed_weight(quantize_weight(module.weight, method))
            elif isinstance(module, ColumnParallelLinear):
                module.set_packed_weight(quantize_weight(module.weight, method))
        model.set_packed_head(quantize_weight(model.output_embedding, method))


def _check_row_shard(linear: RowParallelLinear, method: str) -> None:
    """A row-parallel shard's groups must be the whole weight's groups (start on a boundary)."""
    if method != "int4" or linear.input_shard.start % INT4_GROUP_SIZE == 0:
        return
    raise QuantizationError(
        f"quantization='int4' ({METHODS['int4']}): this rank's input features start at "
        f"{linear.input_shard.start}, not a multiple of the group size {INT4_GROUP_SIZE}; "
        "choose a tensor_parallel_size that splits the layer on group boundaries"
    )
