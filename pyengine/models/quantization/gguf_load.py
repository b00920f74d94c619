"""Load a model from a GGUF file: ``load_model("model.gguf")`` comes here.

The file's metadata gives the config (``GGUFCheckpoint.config_dict``), its tensors fill
the model by Hugging Face name, checked all at once as a folder's are. A quantized
linear weight stays quantized: converted to a :class:`PackedWeight` (``gguf.py``), cut to
this rank's shard along the float weight's axis (rows for a column-parallel linear,
group-aligned input columns for a row-parallel one), merged with its sibling parts
(q/k/v, gate/up) and handed to the linear (``set_packed_weight``). The LM head likewise
(``set_packed_head``; a tied embedding looks its rows up in it). Float tensors (norms,
biases, F16/BF16/F32 matrices) are copied in the engine's dtype.

Two cases cost memory, said here: an untied quantized ``token_embd`` is dequantized to a
float embedding (vocab x hidden in the engine's dtype; the LM head stays quantized), and
merged parts of different types (llama.cpp's Q4_K_M mixes Q4_K and Q6_K) are widened to
int8 at the finer group, losslessly (``merge_parts``). A part in a float type merged with
quantized ones makes the whole linear float (its quantized parts dequantized).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from pyengine.models.config import DecoderConfig, parse_decoder_config
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.errors import WeightMismatchError
from pyengine.models.layers import WeightTarget
from pyengine.models.loader import LoadedModel, instantiate_model
from pyengine.models.parallel import ParallelContext
from pyengine.models.quantization.gguf import convert_tensor
from pyengine.models.quantization.gguf_file import GGUFCheckpoint, hf_tensor_name
from pyengine.models.quantization.packed import PackedWeight, QuantizationError

Weight = Union[torch.Tensor, PackedWeight]


def fill_from_gguf(model: DecoderForCausalLM, checkpoint: GGUFCheckpoint, config: dict[str, Any]) -> None:
    """Every weight of ``model`` from ``checkpoint`` (names and shapes checked first)."""
    tensors = {hf_tensor_name(name) or name: tensor for name, tensor in checkpoint.tensors().items()}
    targets = model.weight_targets()
    missing = sorted(name for name in targets if name not in tensors)
    unexpected = sorted(name for name in tensors if name not in targets and not model.is_ignorable_checkpoint_tensor(name))
    wrong = sorted((name, dest.checkpoint_shape, tensors[name].shape) for name, dest in targets.items()
                   if name in tensors and tuple(tensors[name].shape) != dest.checkpoint_shape)
    if missing or unexpected or wrong:
        raise WeightMismatchError(missing, unexpected, wrong)
    linears = _linear_modules(model)
    groups: dict[int, list[tuple[WeightTarget, Weight]]] = defaultdict(list)
    with torch.no_grad():
        model.zero_padding()
        for name, dest in targets.items():
            t = tensors[name]
            weight = _hf_order(convert_tensor(t.type_name, t.data, t.shape, t.name), checkpoint, name, config)
            weight = _this_rank(weight, dest)
            if name in ("lm_head.weight", "model.embed_tokens.weight"):
                _fill_vocab(model, name, dest, weight)
            elif id(dest.parameter) in linears:
                groups[id(dest.parameter)].append((dest, weight))
            else:
                _copy(dest, _as_float(weight))
        for key, parts in groups.items():
            parts.sort(key=lambda part: part[0].row_offset or 0)
            weights = [w for _, w in parts]
            if all(isinstance(w, PackedWeight) for w in weights):
                linears[key].set_packed_weight(merge_parts(weights))  # type: ignore[arg-type]
            else:
                for dest, w in parts:
                    _copy(dest, _as_float(w))


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
    raw = checkpoint.config_dict()
    config = parse_decoder_config(raw)
    model = instantiate_model(config, dtype, device, parallel)
    fill_from_gguf(model, checkpoint, raw)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, config=config, dtype=dtype, device=device, eos_token_ids=config.eos_token_ids)


def read_gguf_config(path: Path) -> DecoderConfig:
    """The model config of a GGUF file, from its metadata."""
    return parse_decoder_config(GGUFCheckpoint(path).config_dict())


def merge_parts(parts: list[PackedWeight]) -> PackedWeight:
    """One weight of the parts' rows in order. Parts of one layout are concatenated as
    they are; mixed ones (Q4_K with Q6_K) are first widened to int8 at the greatest common
    group size, with biases (zeros where a part had none): exact, at the wider layout's
    memory."""
    first = parts[0]
    same = all((p.bits, p.group_size, p.biases is None) == (first.bits, first.group_size, first.biases is None)
               for p in parts)
    if same:
        return parts[0] if len(parts) == 1 else PackedWeight.concat_rows(parts)
    group = math.gcd(*(p.group_size for p in parts))
    return PackedWeight.concat_rows([_widened(p, group) for p in parts])


def _widened(weight: PackedWeight, group: int) -> PackedWeight:
    """``weight`` as int8 with group ``group`` (a divisor of its own) and biases."""
    repeat = weight.group_size // group
    q = weight.integers().to(torch.int8)
    scales = weight.scales.repeat_interleave(repeat, dim=1)
    biases = torch.zeros_like(scales) if weight.biases is None else weight.biases.repeat_interleave(repeat, dim=1)
    return PackedWeight(bits=8, group_size=group, in_features=weight.in_features, out_features=weight.out_features,
                        qweight=q, scales=scales, biases=biases, input_perm=weight.input_perm)


def _linear_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(weight parameter) -> the linear holding it, for linears that take packed weights."""
    return {id(m.weight): m for m in model.modules() if hasattr(m, "set_packed_weight") and hasattr(m, "weight")}


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


def _this_rank(weight: Weight, dest: WeightTarget) -> Weight:
    """The shard of ``weight`` this rank keeps (see ``WeightTarget``)."""
    shard = dest.shard
    if dest.shard_dim is None or shard is None or (shard.start == 0 and shard.size == shard.full):
        return weight
    if not isinstance(weight, PackedWeight):
        return weight.narrow(dest.shard_dim, shard.start, shard.size)
    if dest.shard_dim == 0:
        return weight.rows(shard.start, shard.size)
    return weight.columns(shard.start, shard.size)


def _fill_vocab(model: DecoderForCausalLM, name: str, dest: WeightTarget, weight: Weight) -> None:
    """The embedding / LM head: a quantized LM head stays quantized (padded with zero rows
    to this rank's vocabulary rows); a quantized untied embedding is dequantized."""
    is_head = name == "lm_head.weight" or model.lm_head is None
    if not isinstance(weight, PackedWeight) or not is_head:
        _copy(dest, _as_float(weight))
        return
    rows = model.output_embedding.shape[0]
    model.set_packed_head(_padded_rows(weight, rows))


def _padded_rows(weight: PackedWeight, rows: int) -> PackedWeight:
    extra = rows - weight.out_features
    if extra == 0:
        return weight
    zero = PackedWeight(
        bits=weight.bits, group_size=weight.group_size, in_features=weight.in_features, out_features=extra,
        qweight=torch.zeros((extra, weight.qweight.shape[1]), dtype=weight.qweight.dtype),
        scales=torch.zeros((extra, weight.groups)),
        biases=None if weight.biases is None else torch.zeros((extra, weight.groups)),
    )
    return PackedWeight.concat_rows([weight, zero])


def _as_float(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, PackedWeight) else weight


def _copy(dest: WeightTarget, tensor: torch.Tensor) -> None:
    target = dest.parameter.data
    if dest.row_offset is not None:
        target = target.narrow(0, dest.row_offset, tensor.shape[0])
    if tuple(target.shape) != tuple(tensor.shape):
        raise QuantizationError(f"GGUF tensor of shape {list(tensor.shape)} does not fit {list(target.shape)}")
    target.copy_(tensor)
