"""Load a model from a GGUF file: ``load_model("model.gguf")`` comes here.

The file's metadata gives the config (``GGUFCheckpoint.config_dict``); its tensors,
converted (``gguf.py``: quantized ones into PackedWeights) and a Llama's q/k rows put back
in Hugging Face order, fill the model through ``fill.fill_model`` (sharding, merging,
what costs memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from pyengine.models.config import DecoderConfig, parse_decoder_config
from pyengine.models.loader import LoadedModel, instantiate_model
from pyengine.models.parallel import ParallelContext
from pyengine.models.quantization.fill import Weight, fill_model
from pyengine.models.quantization.gguf import FLOAT_TYPES, convert_tensor
from pyengine.models.quantization.gguf_file import GGUFCheckpoint, hf_tensor_name
from pyengine.models.quantization.packed import PackedWeight, QuantizationError


def fill_from_gguf(model: torch.nn.Module, checkpoint: GGUFCheckpoint, config: dict[str, Any]) -> None:
    """Every weight of ``model`` from ``checkpoint`` (names and shapes checked first)."""
    tensors = {hf_tensor_name(name) or name: tensor for name, tensor in checkpoint.tensors().items()}

    def read(name: str) -> Weight:
        t = tensors[name]
        return _hf_order(convert_tensor(t.type_name, t.data, t.shape, t.name), checkpoint, name, config)

    fill_model(model, {name: t.shape for name, t in tensors.items()}, read)  # type: ignore[arg-type]


def load_gguf_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    parallel: Optional[ParallelContext],
    quantization: Optional[str],
) -> LoadedModel:
    """The model of a GGUF file and its EOS id (no generation_config: a GGUF file carries
    no sampling defaults). The tokenizer is left to the engine (``gguf_file.gguf_tokenizer``,
    built when no ``tokenizer=`` is given): tensor-parallel workers load models too, and
    building a tokenizer from GGUF metadata takes transformers seconds."""
    if quantization is not None:
        raise QuantizationError(
            f"quantization={quantization!r} quantizes a float checkpoint at load; {path.name} is a GGUF file, "
            "whose weights are loaded in the file's own types: leave quantization unset"
        )
    checkpoint = GGUFCheckpoint(path)
    if device.type != "cpu":
        packed = sorted({t.type_name for t in checkpoint.tensors().values() if t.type_name not in FLOAT_TYPES})
        if packed:
            raise QuantizationError(
                f"{path.name} holds {', '.join(packed)} tensors, which run on CPU only yet: their packed "
                f"products have no kernel for device {device.type!r} (an F16 / BF16 GGUF file loads there)"
            )
    raw = checkpoint.config_dict()
    config = parse_decoder_config(raw)
    model = instantiate_model(config, dtype, device, parallel)
    fill_from_gguf(model, checkpoint, raw)
    model.eval().requires_grad_(False)
    model.finish_loading()
    return LoadedModel(model=model, config=config, dtype=dtype, device=device, eos_token_ids=config.eos_token_ids)


def read_gguf_config(path: Path) -> DecoderConfig:
    """The model config of a GGUF file, from its metadata."""
    return parse_decoder_config(GGUFCheckpoint(path).config_dict())


def _hf_order(weight: Weight, checkpoint: GGUFCheckpoint, name: str, config: dict[str, Any]) -> Weight:
    rows = weight.out_features if isinstance(weight, PackedWeight) else weight.shape[0]
    order = checkpoint.hf_row_order(name, rows, config)
    if order is None:
        return weight
    index = torch.from_numpy(np.ascontiguousarray(order))
    if not isinstance(weight, PackedWeight):
        return weight.index_select(0, index)
    return PackedWeight(
        bits=weight.bits, group_size=weight.group_size, in_features=weight.in_features,
        out_features=weight.out_features, qweight=weight.qweight.index_select(0, index),
        scales=weight.scales.index_select(0, index),
        biases=None if weight.biases is None else weight.biases.index_select(0, index),
    )
