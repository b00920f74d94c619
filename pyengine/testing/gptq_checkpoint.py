"""GPTQ and AWQ checkpoints written from a float one, packed from the formats' specs (their
own libraries, AutoGPTQ / GPTQModel and AutoAWQ, need CUDA to quantize), for tests.

Each decoder-layer linear is quantized round-to-nearest with a group size, symmetric or
with zero points, GPTQ optionally with act-order (a random group per input channel,
``g_idx``, ``desc_act: true``); the tensors are packed as the formats store them (see
``pyengine/models/quantization/gptq.py`` and ``awq.py``) and config.json gets the
``quantization_config`` those libraries write. The writer also returns the weights its
integers stand for, dequantized here from the integers and scales: the reference a float
model (transformers) runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def write_quantized(folder: Path, target: Path, method: str, *, bits: int = 4, group_size: int = 32,
                    sym: bool = False, desc_act: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """``folder``'s checkpoint as a ``method`` ("gptq" or "awq") checkpoint in ``target``;
    returns the dequantized float tensors (every tensor, by name)."""
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in _LINEARS):
            out[name] = tensor
            reference[name] = tensor.float()
            continue
        w = tensor.float()
        n, k = w.shape
        g_idx = torch.arange(k) // group_size
        if desc_act:
            g_idx = g_idx[torch.randperm(k, generator=generator)]
        q, scales, zeros = _round_to_nearest(w, g_idx, k // group_size, bits, sym)
        reference[name] = (q.float() - zeros[g_idx].t()) * scales[g_idx].t()  # [N, K]
        if method == "gptq":
            out[f"{prefix}.qweight"] = _pack_rows(q.t(), bits)  # q [N, K] -> [K, N] packed along K
            out[f"{prefix}.qzeros"] = _pack_columns(zeros.to(torch.int32) - 1, bits)
            out[f"{prefix}.scales"] = scales.half()
            out[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        else:
            out[f"{prefix}.qweight"] = _pack_awq(q.t())
            out[f"{prefix}.qzeros"] = _pack_awq(zeros.to(torch.int32))
            out[f"{prefix}.scales"] = scales.half()
    save_file({k: v.contiguous() for k, v in out.items()}, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq"}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "version": "gemm", "zero_point": True}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return reference


def _round_to_nearest(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """q int32 [N, K] in 0..2^bits-1, scales float [groups, N], zeros float [groups, N]."""
    top = (1 << bits) - 1
    n, _ = w.shape
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale = cols.abs().amax(dim=1).clamp_min(1e-8) / ((top + 1) / 2 - 1)
            zero = torch.full((n,), float((top + 1) // 2))
        else:
            low, high = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = ((high - low) / top).clamp_min(1e-8)
            zero = torch.round(-low / scale).clamp(0, top)
        scales[g], zeros[g] = scale.half().float(), zero  # scales as the file will hold them
    q = torch.round(w / scales[g_idx].t() + zeros[g_idx].t()).clamp(0, top).to(torch.int32)
    return q, scales, zeros


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] -> int32 [R * bits / 32, C], consecutive rows in one word, lowest first."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0] // per, per, values.shape[1])
    words = sum(v[:, j] << (bits * j) for j in range(per))
    return _as_int32(words)


def _pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    return _pack_rows(values.t().contiguous(), bits).t().contiguous()


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R, C / 8], word c holding columns 8c + AWQ_ORDER[i] in bits 4i."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    words = sum(v[:, :, AWQ_ORDER[i]] << (4 * i) for i in range(8))
    return _as_int32(words)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
