"""Choose the attention backend for a device, with a logged reason."""

from __future__ import annotations

import logging
from typing import Union

import torch

from pyengine.errors import AttentionBackendUnavailableError, InvalidConfigError
from pyengine.executor.attention.flash import FlashAttentionBackend, import_flash_varlen
from pyengine.executor.attention.sdpa import SdpaBackend

logger = logging.getLogger(__name__)

AttentionBackendChoice = Union[SdpaBackend, FlashAttentionBackend]


def select_attention_backend(
    requested: str, device: torch.device, dtype: torch.dtype
) -> AttentionBackendChoice:
    """``requested`` is "auto", "sdpa" or "flash_attn"; "auto" prefers flash-attn on CUDA."""
    if requested == "sdpa":
        logger.info("attention backend: sdpa (forced by configuration)")
        return SdpaBackend()
    flash = import_flash_varlen()
    flash_problem = _flash_problem(flash is not None, device, dtype)
    if requested == "flash_attn":
        if flash_problem:
            raise AttentionBackendUnavailableError(
                f"attention_backend='flash_attn' cannot be used: {flash_problem}"
            )
        logger.info("attention backend: flash_attn (forced by configuration)")
        return FlashAttentionBackend(flash)
    if requested != "auto":
        raise InvalidConfigError(f"attention_backend must be 'auto', 'sdpa' or 'flash_attn', got {requested!r}")
    if flash_problem:
        logger.info("attention backend: sdpa (flash_attn not used: %s)", flash_problem)
        return SdpaBackend()
    logger.info("attention backend: flash_attn (CUDA, %s, flash-attn importable)", dtype)
    return FlashAttentionBackend(flash)


def _flash_problem(importable: bool, device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cuda":
        return f"device is {device.type}, flash-attn needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype is {dtype}, flash-attn needs float16 or bfloat16"
    if not importable:
        return "the flash_attn package is not installed"
    return ""
