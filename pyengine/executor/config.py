"""Executor settings: one frozen object passed explicitly to the ModelRunner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

AttentionBackendName = Literal["auto", "sdpa", "flash_attn"]

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """How the executor loads the model and sizes the KV cache.

    - ``dtype``: "auto" (float32 on CPU, bfloat16 on CUDA when supported), "float32",
      "bfloat16" or "float16".
    - ``kv_cache_bytes``: KV budget. Default on CPU: 4 GiB; on CUDA the budget is
      ``gpu_memory_utilization`` of the device minus weights and the activation peak
      measured by a profiling forward, unless this is set.
    - ``num_kv_blocks``: force an exact number of blocks (tests), overriding the budget.
    - ``max_num_seqs``: rows of the persistent batch; ``max_model_len``: longest sequence
      (defaults to the model's ``max_position_embeddings``).
    - ``attention_backend``: "auto" picks flash-attn on CUDA when importable, else SDPA.
    """

    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None
    max_num_batched_tokens: int = 8192
    kv_cache_bytes: Optional[int] = None
    num_kv_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    attention_backend: AttentionBackendName = "auto"
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    seed: int = 0
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        checks = [
            (self.block_size >= 1, "block_size", "must be >= 1", self.block_size),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1", self.max_num_seqs),
            (
                self.max_model_len is None or self.max_model_len >= 1,
                "max_model_len",
                "must be >= 1",
                self.max_model_len,
            ),
            (
                self.max_num_batched_tokens >= 1,
                "max_num_batched_tokens",
                "must be >= 1",
                self.max_num_batched_tokens,
            ),
            (
                self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
                "kv_cache_bytes",
                "must be > 0",
                self.kv_cache_bytes,
            ),
            (
                self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                "num_kv_blocks",
                "must be >= 1",
                self.num_kv_blocks,
            ),
            (
                0.0 < self.gpu_memory_utilization <= 1.0,
                "gpu_memory_utilization",
                "must be in (0, 1]",
                self.gpu_memory_utilization,
            ),
            (
                self.attention_backend in ("auto", "sdpa", "flash_attn"),
                "attention_backend",
                "must be 'auto', 'sdpa' or 'flash_attn'",
                self.attention_backend,
            ),
            (self.max_logprobs >= 0, "max_logprobs", "must be >= 0", self.max_logprobs),
        ]
        for ok, name, requirement, value in checks:
            if not ok:
                raise ValueError(f"{name} {requirement}, got {value!r}")
