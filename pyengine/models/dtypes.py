"""The names of the model's dtypes, as engine arguments spell them.

Plain data and no torch: the engine and executor configurations validate ``dtype`` with
these names, and the loader (``models/loader.py``) turns the canonical name into a torch
dtype. Kept beside the loader so that the model code depends on nothing of the executor.
"""

from __future__ import annotations

from typing import Any

#: Canonical dtype names, and the other spellings accepted for them (vLLM's ``half`` and
#: ``float`` among them); torch dtypes (``torch.float16``) are accepted too.
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}


def normalize_dtype(dtype: Any) -> Any:
    """The canonical name of ``dtype`` ("half" -> "float16", ``torch.bfloat16`` -> "bfloat16");
    anything else unchanged, for the dtype rule to refuse with the argument's name."""
    if type(dtype).__module__ == "torch" and str(dtype).startswith("torch."):  # a torch.dtype; no torch import
        dtype = str(dtype)[len("torch."):]
    if isinstance(dtype, str):
        return DTYPE_ALIASES.get(dtype.strip().lower(), dtype.strip().lower())
    return dtype
