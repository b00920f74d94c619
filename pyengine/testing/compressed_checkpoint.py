"""compressed-tensors checkpoints written from a float one by the format's own library, for
tests.

The float checkpoint is loaded in transformers, the ``compressed_tensors`` package attaches
a quantization scheme to every ``Linear`` but those in ``ignore`` (``lm_head`` always),
the weights' scales and zero points are set round-to-nearest from their min / max
(``calculate_qparams``: what llm-compressor's default min-max observer gives, without
calibration data, which the format does not record), and ``ModelCompressor`` packs them
and writes config.json's ``quantization_config`` as llm-compressor's ``save_pretrained``
does. The reference is the same library's decompression of those tensors: the float
weights the stored integers / FP8 values stand for, which a float model (transformers)
runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams

# The schemes the tests write: (format, weight args, input activation args).
SCHEMES: dict[str, tuple[str, dict[str, Any], Optional[dict[str, Any]]]] = {
    "w4a16-group-asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                group_size=32), None),
    "w4a16-group-sym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                               group_size=32), None),
    "w8a16-channel-sym": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"), None),
    "w8a16-group-asym": ("pack-quantized", dict(num_bits=8, type="int", symmetric=False, strategy="group",
                                                group_size=64), None),
    "w8a8-int": ("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                 dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                   dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                    dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)),
    "fp8-block": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="block",
                                          block_structure=[128, 128]),
                  dict(num_bits=8, type="float", symmetric=True, strategy="group", group_size=128, dynamic=True)),
}


def write_compressed(folder: Path, target: Path, scheme: str, ignore: tuple[str, ...] = ("lm_head",)
                     ) -> dict[str, torch.Tensor]:
    """``folder``'s checkpoint as a compressed-tensors ``scheme`` (a ``SCHEMES`` key)
    checkpoint in ``target``; returns the dequantized float tensors (every tensor, by name)."""
    fmt, weights, inputs = SCHEMES[scheme]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    float_names = set(model.state_dict())
    group = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                               input_activations=None if inputs is None else QuantizationArgs(**inputs))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": group}, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                _set_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(str(target))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (folder / name).exists():
            shutil.copy(folder / name, target / name)
    compressor.decompress_model(model)
    state = model.state_dict()
    return {name: state[name].detach().to(torch.float32).clone() for name in float_names}


def _set_qparams(module: torch.nn.Module) -> None:
    """Min-max scale (and zero point) of the module's weight at its scheme's granularity."""
    args = module.quantization_scheme.weights
    w = module.weight.data.to(torch.float32)
    n, k = w.shape
    if args.strategy == "group":
        blocks = w.view(n, k // args.group_size, args.group_size)
        low, high = blocks.amin(-1), blocks.amax(-1)
    elif args.strategy == "channel":
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "tensor":
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    else:  # block: [ceil(N / R), ceil(K / C)], edge blocks partial
        rows, cols = args.block_structure
        padded = torch.nn.functional.pad(w, (0, -k % cols, 0, -n % rows), value=0.0)
        blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
        low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    scale, zero = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
