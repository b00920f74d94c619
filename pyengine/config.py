"""Engine arguments: one frozen, validated object passed explicitly to the engine.

``EngineConfig`` gathers what the scheduler (Rust) and the executor (PyTorch) need and
checks their combinations once, at construction, with messages that name the argument.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pyengine._sched import SchedulerConfig
from pyengine.errors import InvalidConfigError
from pyengine.executor.config import ExecutorConfig, check_executor_settings, normalize_dtype

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine is built from.

    - ``model``: a Hugging Face checkpoint folder; ``None`` = the built-in tiny Qwen3
      checkpoint (random weights, trained tokenizer), built once into ``~/.cache/pyengine``.
      ``from_kwargs`` (used by ``LLM`` and ``pyengine serve``) also takes a hub id
      (``"Qwen/Qwen3-0.6B"``) and stores the local snapshot folder it resolves to
      (``pyengine.models.hub``); the constructor itself does no I/O beyond checking the folder.
    - ``dtype``: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16";
      vLLM's aliases "half" (float16) and "float" (float32), and torch dtypes
      (``torch.float16``), are stored as these canonical names.
    - ``device``: "cpu", "cuda", "cuda:N".
    - ``kv_cache_bytes`` / ``num_kv_blocks``: the KV cache budget (default: 4 GiB on CPU, a
      fraction ``gpu_memory_utilization`` of the GPU), or an exact block count.
    - ``max_num_seqs``: running sequences at most; ``max_num_batched_tokens``: tokens per step.
    - ``max_model_len``: longest sequence; default the model's ``max_position_embeddings``.
    - ``long_prefill_token_threshold``: cap on one prompt's tokens per step (0 = budget only).
    - ``pipeline_depth``: 2 plans step N+1 while N runs (the default); 1 plans, runs and
      updates in turn (for debugging and to measure what the overlap buys).
    - ``scheduling_policy``: "fcfs" or "priority" (lower ``priority`` runs first).
    """

    model: Optional[Union[str, Path]] = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: Optional[int] = None
    num_kv_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    pipeline_depth: int = 2
    scheduling_policy: SchedulingPolicy = "fcfs"
    seed: int = 0
    attention_backend: Literal["auto", "sdpa", "flash_attn"] = "auto"
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, requirement: str) -> None:
            if not ok:
                raise InvalidConfigError(f"{name} {requirement}, got {getattr(self, name)!r}")

        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        check_executor_settings(self)
        need(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0")
        need(self.pipeline_depth in (1, 2), "pipeline_depth", "must be 1 or 2")
        need(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "must be 'fcfs' or 'priority'")
        if self.max_model_len is not None:
            need(self.max_num_batched_tokens >= min(self.max_num_seqs, self.max_model_len),
                 "max_num_batched_tokens", f"must be >= max_num_seqs ({self.max_num_seqs})")
        else:
            need(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                 f"must be >= max_num_seqs ({self.max_num_seqs})")
        if self.model is not None and self.load_format != "dummy":
            path = Path(self.model)
            if not (path / "config.json").is_file():
                from pyengine.models.hub import looks_like_hub_id

                if looks_like_hub_id(self.model):
                    raise InvalidConfigError(
                        f"model {self.model!r} is not a checkpoint folder; it looks like a Hugging Face hub id, "
                        "which EngineConfig.from_kwargs (LLM, pyengine serve) resolves to a local snapshot"
                    )
                raise InvalidConfigError(
                    f"model {str(self.model)!r} is not a checkpoint folder (no config.json there); "
                    "pyengine loads local Hugging Face checkpoint folders"
                )

    def executor_config(self) -> ExecutorConfig:
        """The executor's settings: every ExecutorConfig field, taken by name from here."""
        return ExecutorConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ExecutorConfig)})

    def scheduler_config(self, num_blocks: int, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings, once the KV cache size and the model's length are known."""
        return SchedulerConfig(
            num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_prefix_caching=self.enable_prefix_caching,
            policy=self.scheduling_policy,
            pipeline_depth=self.pipeline_depth,
        )

    @classmethod
    def from_kwargs(cls, model: Optional[Union[str, Path]] = None, **kwargs: Any) -> EngineConfig:
        """Builds a config from engine arguments; an unknown argument is an error naming it.

        A ``model`` that is not an existing path but looks like a hub id (``ORG/NAME``) is
        resolved here, once, to its local snapshot folder (the cache first, downloading
        unless ``HF_HUB_OFFLINE=1``): this is the one place the engine may touch the
        network, so that constructing or copying an ``EngineConfig`` never does."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        from pyengine.models.hub import looks_like_hub_id, resolve_model

        if looks_like_hub_id(model):
            cls(model=None, **kwargs)  # every other argument's error before any download
        model = resolve_model(model, need_weights=kwargs.get("load_format", "auto") != "dummy")
        return cls(model=model, **kwargs)
