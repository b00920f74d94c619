"""Size the KV cache: a byte budget on CPU, measured free memory on CUDA."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from pyengine.executor.config import DEFAULT_CPU_KV_CACHE_BYTES, ExecutorConfig
from pyengine.executor.kv_cache import KVCacheShape, KVCacheTooSmallError, blocks_for_budget
from pyengine.executor.proposals import ProposerCacheSize

logger = logging.getLogger(__name__)


def decide_num_blocks(
    config: ExecutorConfig,
    shape: KVCacheShape,
    device: torch.device,
    most_useful: int,
    profile_forward: Callable[[], None],
    proposer: Optional[ProposerCacheSize] = None,
) -> int:
    """How many KV blocks to allocate.

    ``num_kv_blocks`` wins when set; else ``kv_cache_bytes``; else 4 GiB on CPU and, on
    CUDA, ``gpu_memory_utilization`` of the device minus what is in use after a profiling
    forward (``profile_forward``, the largest steps the executor will run) and its peak
    (a proposer's weights, loaded before, are in use). A proposer's own cache
    (``proposer``: a draft model's or EAGLE-3 head's, on this rank) is paid from the same
    budget: its scratch blocks first, then one of its blocks beside each of the target's.
    The result is capped at ``most_useful`` (every row at max_model_len).
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    elif device.type != "cuda":
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    else:
        budget = _cuda_budget(config, device, profile_forward)
    if proposer is None:
        return blocks_for_budget(shape, budget, most_useful)
    per_block = shape.bytes_per_block + proposer.shape.bytes_per_block
    left = budget - proposer.scratch_blocks * proposer.shape.bytes_per_block
    if left < per_block:
        raise KVCacheTooSmallError(
            f"KV cache budget of {budget} bytes holds no block beside the proposer's cache (its "
            f"{proposer.scratch_blocks} scratch blocks need {proposer.scratch_blocks * proposer.shape.bytes_per_block} "
            f"bytes; one block of both caches {per_block})"
        )
    return int(min(left // per_block, most_useful))


def _cuda_budget(config: ExecutorConfig, device: torch.device, profile_forward: Callable[[], None]) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile_forward()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = int(total * config.gpu_memory_utilization - in_use - activation_peak)
    logger.info(
        "CUDA memory: total %.2f GiB, in use %.2f GiB, activation peak %.2f GiB -> KV budget %.2f GiB",
        total / 2**30,
        in_use / 2**30,
        activation_peak / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise KVCacheTooSmallError(
            f"no memory left for the KV cache: gpu_memory_utilization={config.gpu_memory_utilization} of "
            f"{total / 2**30:.1f} GiB, {in_use / 2**30:.1f} GiB in use, activation peak {activation_peak / 2**30:.2f} GiB"
        )
    return budget
