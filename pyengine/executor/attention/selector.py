"""Choose the attention backend for a device, with a logged reason, and the KV block
size that goes with it when the configuration leaves it to the platform."""

from __future__ import annotations

import dataclasses
import logging
from typing import Union

import torch

from pyengine.errors import AttentionBackendUnavailableError, InvalidConfigError
from pyengine.executor.attention.flash import (
    FLASH_PAGED_BLOCK_MULTIPLE,
    FlashAttentionBackend,
    import_flash_varlen,
)
from pyengine.executor.attention.mla_sdpa import MlaSdpaBackend
from pyengine.executor.attention.sdpa import SdpaBackend
from pyengine.executor.config import ExecutorConfig
from pyengine.models.dtypes import normalize_dtype

logger = logging.getLogger(__name__)

# What select_attention_backend picks (over a paged K/V cache); a model runner's backend
# may also be the latent-attention one (select_latent_attention_backend).
PagedAttentionBackend = Union[SdpaBackend, FlashAttentionBackend]
AttentionBackendChoice = Union[PagedAttentionBackend, MlaSdpaBackend]


def select_latent_attention_backend(requested: str) -> MlaSdpaBackend:
    """Multi-head latent attention (DeepSeek) has one backend, over the latent cache: the
    native decode kernel (CPU float32) and SDPA. flash-attn's kernels take keys and
    values of one head size per head, not MLA's shared latent row."""
    if requested == "flash_attn":
        raise AttentionBackendUnavailableError(
            "attention_backend='flash_attn' cannot run multi-head latent attention (DeepSeek-V2 / V3): "
            "use 'auto' or 'sdpa'"
        )
    if requested not in ("auto", "sdpa"):
        raise InvalidConfigError(f"attention_backend must be 'auto', 'sdpa' or 'flash_attn', got {requested!r}")
    logger.info("attention backend: mla_sdpa (multi-head latent attention over the latent cache)")
    return MlaSdpaBackend()


def select_attention_backend(
    requested: str, device: torch.device, dtype: torch.dtype
) -> PagedAttentionBackend:
    """``requested`` is "auto", "sdpa" or "flash_attn"; "auto" prefers flash-attn on CUDA."""
    if requested == "sdpa":
        logger.info("attention backend: sdpa (forced by configuration)")
        return SdpaBackend()
    flash = import_flash_varlen()
    flash_problem = flash_attn_problem(device, dtype)
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


def flash_attn_problem(device: torch.device, dtype: torch.dtype) -> str:
    """Why flash-attn cannot run the attention for ``device`` and ``dtype`` ("" when it
    can): it needs CUDA, float16 or bfloat16, and a flash_attn package that imports (one
    that is installed but broken, an ABI mismatch, counts as missing)."""
    if device.type != "cuda":
        return f"device is {device.type}, flash-attn needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype is {dtype}, flash-attn needs float16 or bfloat16"
    if import_flash_varlen() is None:
        return "the flash_attn package is not installed or does not import"
    return ""


def flash_attn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether "auto" picks flash-attn for ``device`` and ``dtype`` (``flash_attn_problem``)."""
    return not flash_attn_problem(device, dtype)


#: KV block size (tokens) when none is given: 256 where flash-attn runs the attention, the
#: smallest block upstream flash-attn reads in place through a block table (smaller
#: blocks make every layer gather the whole context into a packed copy, see flash.py);
#: 16 everywhere else (the CPU, SDPA on CUDA), which the native decode kernel and a finer
#: prefix cache prefer. The block is also the prefix cache's granularity: only full
#: blocks are shared.
FLASH_ATTN_BLOCK_SIZE = FLASH_PAGED_BLOCK_MULTIPLE
SMALL_BLOCK_SIZE = 16


def default_block_size(device: str, attention_backend: str = "auto", dtype: str = "auto") -> int:
    """The block size for ``block_size=None``: 256 when the attention backend that will be
    chosen for these settings is flash-attn (forced, or "auto" where ``flash_attn_usable``
    says it runs), else 16. The runner decides it when it starts, before the model loads
    (tensor-parallel ranks size their plan channel with it), so that building a
    configuration never probes the platform."""
    if not str(device).startswith("cuda") or attention_backend == "sdpa":
        return SMALL_BLOCK_SIZE
    if attention_backend == "flash_attn":
        return FLASH_ATTN_BLOCK_SIZE
    # "auto" is a half-precision dtype on CUDA (bfloat16, or float16 where unsupported).
    torch_dtype = torch.float32 if normalize_dtype(dtype) == "float32" else torch.bfloat16
    return FLASH_ATTN_BLOCK_SIZE if flash_attn_usable(torch.device(str(device)), torch_dtype) else SMALL_BLOCK_SIZE


def resolve_block_size(config: ExecutorConfig) -> ExecutorConfig:
    """``config`` with its block size decided: the given one, else ``default_block_size``."""
    if config.block_size is not None:
        return config
    return dataclasses.replace(
        config, block_size=default_block_size(config.device, config.attention_backend, config.dtype)
    )
