"""Executor settings: one frozen object passed explicitly to the ModelRunner.

Plain data: nothing here imports torch or looks at the platform. What depends on the
platform (the KV block size where none is given: 256 where flash-attn will run) is
resolved by the runner that starts on it (``executor/attention/selector.py``,
``resolve_block_size``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from pyengine.errors import InvalidConfigError
from pyengine.models.dtypes import DTYPE_NAMES, normalize_dtype

AttentionBackendName = Literal["auto", "sdpa", "flash_attn"]

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """How the executor loads the model and sizes the KV cache.

    - ``dtype``: "auto" (float32 on CPU, bfloat16 on CUDA when supported), "float32",
      "bfloat16" or "float16"; aliases ("half", "float", ...) and torch dtypes are stored
      as these names (``normalize_dtype``).
    - ``kv_cache_bytes``: KV budget. Default on CPU: 4 GiB; on CUDA the budget is
      ``gpu_memory_utilization`` of the device minus weights and the activation peak
      measured by a profiling forward, unless this is set.
    - ``num_kv_blocks``: force an exact number of blocks (tests), overriding the budget.
    - ``block_size``: tokens per KV block; None: the runner's platform default
      (``selector.default_block_size``: 256 when flash-attn runs the attention on CUDA,
      else 16), resolved when the runner starts.
    - ``max_num_seqs``: rows of the persistent batch; ``max_model_len``: longest sequence
      (defaults to the model's ``max_position_embeddings``).
    - ``attention_backend``: "auto" picks flash-attn on CUDA when importable, else SDPA.
    - ``quantization``: None, or "int8" / "int4" (weight-only) / "fp8" (e4m3 weights and
      per-token activations) to quantize a float checkpoint's linear weights at load;
      the device picks the kernel (CPU, CUDA; docs/quantization.md).
    - ``logits_processors``: custom ``LogitsProcessor`` classes (or qualified names) run
      after the built-in ones, on tensor-parallel rank 0 (docs/logits_processors.md).
    - ``speculative_config``: speculative decoding's settings (a ``SpeculativeConfig`` or
      its dict); the executor loads a draft model for method "draft_model", an EAGLE-3
      head for "eagle3" (docs/speculative_decoding.md).
    - ``enable_expert_parallel``: under tensor parallelism, each rank holds whole routed
      experts (an even share of them) instead of a slice of every expert
      (docs/tensor_parallel.md); no effect on a dense model or at size 1.
    """

    dtype: str = "auto"
    device: str = "cpu"
    block_size: Optional[int] = None
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
    logits_processors: tuple[Any, ...] = ()
    quantization: Optional[str] = None
    speculative_config: Optional[Any] = None
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        from pyengine.speculative_config import SpeculativeConfig

        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))
        check_executor_settings(self)


# The executor's settings and what each must satisfy: checked here for an ExecutorConfig
# built directly (tests, benches) and by EngineConfig for the same-named engine
# arguments, so each rule is written once.
EXECUTOR_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("dtype", lambda v: v in DTYPE_NAMES,
     "must be 'auto', 'float32', 'bfloat16' or 'float16' (or 'half', 'float', a torch dtype)"),
    ("device", lambda v: v == "cpu" or str(v).startswith("cuda"), "must be 'cpu' or 'cuda[:N]'"),
    ("block_size", lambda v: v is None or v >= 1, "must be >= 1"),
    ("max_num_seqs", lambda v: v >= 1, "must be >= 1"),
    ("max_model_len", lambda v: v is None or v >= 1, "must be >= 1"),
    ("max_num_batched_tokens", lambda v: v >= 1, "must be >= 1"),
    ("kv_cache_bytes", lambda v: v is None or v > 0, "must be > 0"),
    ("num_kv_blocks", lambda v: v is None or v >= 1, "must be >= 1"),
    ("gpu_memory_utilization", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    ("attention_backend", lambda v: v in ("auto", "sdpa", "flash_attn"), "must be 'auto', 'sdpa' or 'flash_attn'"),
    ("load_format", lambda v: v in ("auto", "safetensors", "dummy"), "must be 'auto', 'safetensors' or 'dummy'"),
    ("max_logprobs", lambda v: v >= 0, "must be >= 0"),
    ("enable_expert_parallel", lambda v: isinstance(v, bool), "must be True or False"),
    ("quantization", lambda v: v is None or v in ("int8", "int4", "fp8"),
     "must be None, 'int8', 'int4' or 'fp8'"),
)


def check_executor_settings(config: Any) -> None:
    """Raises ``InvalidConfigError`` naming the first executor setting of ``config`` (an
    ExecutorConfig or an EngineConfig) that breaks its rule."""
    for name, ok, requirement in EXECUTOR_RULES:
        value = getattr(config, name)
        if not ok(value):
            raise InvalidConfigError(f"{name} {requirement}, got {value!r}")
