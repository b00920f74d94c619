"""Engine arguments: one frozen, validated object passed explicitly to the engine.

``EngineConfig`` gathers what the scheduler (Rust) and the executor (PyTorch) need and
checks their combinations once, at construction, with messages that name the argument.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from pyengine._sched import SchedulerConfig
from pyengine.errors import InvalidConfigError

if TYPE_CHECKING:
    from pyengine.kv_events.config import KVEventsConfig
from pyengine.executor.config import ExecutorConfig, check_executor_settings
from pyengine.models.dtypes import normalize_dtype
from pyengine.speculative_config import SpeculativeConfig

SchedulingPolicy = Literal["fcfs", "priority"]
TASKS = ("auto", "generate", "embed")
RUNNERS = ("auto", "generate", "pooling")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine is built from.

    - ``model``: a Hugging Face checkpoint folder, or a GGUF file (``*.gguf``, llama.cpp's
      format; docs/quantization.md); ``None`` = the built-in tiny Qwen3
      checkpoint (random weights, trained tokenizer), built once into ``~/.cache/pyengine``.
      ``from_kwargs`` (used by ``LLM`` and ``pyengine serve``) also takes a hub id
      (``"Qwen/Qwen3-0.6B"``) and stores the local snapshot folder it resolves to
      (``pyengine.models.hub``); the constructor itself does no I/O beyond checking the folder.
    - ``dtype``: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16";
      vLLM's aliases "half" (float16) and "float" (float32), and torch dtypes
      (``torch.float16``), are stored as these canonical names.
    - ``device``: "cpu", "cuda", "cuda:N".
    - ``block_size``: tokens per KV block, and the prefix cache's granularity; None (the
      default) leaves it to the model runner, which decides it when it starts (the
      configuration stays plain data and probes nothing): 256 when flash-attn runs the
      attention (CUDA, with flash-attn installed or forced, and a half-precision dtype),
      the smallest block upstream flash-attn reads in place through its block table; else
      16 (the CPU, SDPA on CUDA). ``EngineCore.block_size`` is the size in use.
    - ``kv_cache_bytes`` / ``num_kv_blocks``: the KV cache budget (default: 4 GiB on CPU, a
      fraction ``gpu_memory_utilization`` of the GPU), or an exact block count.
    - ``max_num_seqs``: running sequences at most; ``max_num_batched_tokens``: tokens per step.
    - ``max_model_len``: longest sequence; default the model's ``max_position_embeddings``.
    - ``long_prefill_token_threshold``: cap on one prompt's tokens per step (0 = budget only).
    - ``pipeline_depth``: 2 plans step N+1 while N runs (the default); 1 plans, runs and
      updates in turn (for debugging and to measure what the overlap buys).
    - ``scheduling_policy``: "fcfs" or "priority" (lower ``priority`` runs first).
    - ``data_parallel_size``: engine cores, one process each, behind one multi-process
      front end (``make_engine_client(config, multiprocess=True)``, ``pyengine serve``); on CPU each
      gets its share of the CPUs, on CUDA its own device. An in-process engine takes 1.
    - ``tensor_parallel_size``: ranks the model is split over (1: no split). Above 1 the
      engine starts N-1 worker processes on this host, each holding a weight shard (see
      docs/tensor_parallel.md).
    - ``distributed_executor_backend``: "mp" (the engine starts the workers on this host)
      or "external_launcher" (every rank is started by torchrun or alike, possibly on
      several hosts, and runs the same program: rank 0 becomes the engine, the others
      serve it and exit with it; vLLM's name for the same).
    - ``enable_expert_parallel``: under tensor parallelism, a mixture-of-experts model's
      routed experts are split whole across the ranks (each holds ``num_experts / N``
      of them) instead of each rank holding a slice of every expert (vLLM's name; the
      expert count must divide ``tensor_parallel_size``; no effect on a dense model).
    - ``disable_custom_all_reduce``: with "mp" on the CPU, the forward pass's all-reduces
      and logits gather go through a shared-memory segment of the host's ranks instead
      of gloo's loopback TCP (docs/tensor_parallel.md); True sends them through
      ``torch.distributed`` (vLLM's name for the same switch).
    - ``kv_events_config``: KV-cache events for prefix-aware routers, vLLM's
      ``KVEventsConfig`` as a JSON object or dict (``{"enable_kv_cache_events": true,
      "endpoint": "tcp://*:5557", ...}``; docs/kv_events.md). Off by default: no socket.

    Arguments vLLM takes, accepted here with the same meaning (or none, said so):

    - ``trust_remote_code``: accepted; pyengine never executes a checkpoint's own Python
      code (it implements the architectures it supports). ``from_kwargs`` logs a warning
      when it is True and the checkpoint's config.json has an ``auto_map``.
    - ``enforce_eager``: accepted, no effect: pyengine has no CUDA graph capture, it always
      runs eagerly.
    - ``disable_log_stats``: accepted; the engine core logs no periodic stats line, so it
      has no effect here (the server's stats lines follow ``--stats-interval``).
    - ``tokenizer``: a folder holding another tokenizer (its tokenizer.json, and
      tokenizer_config.json / chat_template.jinja for special tokens and the chat
      template), or a hub id ``from_kwargs`` resolves as it resolves the model (at
      ``tokenizer_revision``); None (or the model argument itself) is the model's own.
      It tokenizes and detokenizes everywhere (engine, multi-process front end, server,
      ``LLM.get_tokenizer``); the model's EOS ids still come from the model.
    - ``revision``, ``download_dir``: the hub revision and the cache folder ``from_kwargs``
      resolves a hub id with (ignored for a local folder).
    - ``task``: "auto", "generate" or "embed"; ``runner``: "auto", "generate" or
      "pooling". Stored and checked; the engine serves both generation and embeddings
      whatever they say.
    - ``generation_config``: "auto" (the default) makes the checkpoint's
      generation_config.json sampling defaults (temperature, top_p, top_k, min_p,
      repetition_penalty, max_new_tokens as max_tokens) the defaults of
      ``LLM.get_default_sampling_params()`` and of every server request that does not
      set them, as vLLM does; "vllm" ignores them; a folder path reads them from that
      folder's generation_config.json instead (vLLM's three forms).
    - ``quantization``: None, "int8" (weight-only, per output channel), "int4"
      (weight-only, groups of 128, asymmetric) or "fp8" (e4m3 weights per channel, e4m3
      activations per token): a float checkpoint's linear weights quantized at load, as
      vLLM's online quantization does (CPU kernels, or torch's on CUDA; docs/quantization.md).
    - ``speculative_config``: None (off), or vLLM v1's dict (``{"method": "ngram",
      "num_speculative_tokens": 4}``; its JSON on the command line), stored as a
      :class:`~pyengine.speculative_config.SpeculativeConfig` (docs/speculative_decoding.md).
    """

    model: Optional[Union[str, Path]] = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: Optional[int] = None
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
    trust_remote_code: bool = False
    enforce_eager: bool = False
    disable_log_stats: bool = False
    tokenizer: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    revision: Optional[str] = None
    download_dir: Optional[str] = None
    task: str = "auto"
    runner: str = "auto"
    generation_config: str = "auto"
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    disable_custom_all_reduce: bool = False
    enable_expert_parallel: bool = False
    logits_processors: tuple[Any, ...] = ()
    quantization: Optional[str] = None
    speculative_config: Optional[SpeculativeConfig] = None
    kv_events_config: Optional[Union[str, dict[str, Any]]] = None

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, requirement: str) -> None:
            if not ok:
                raise InvalidConfigError(f"{name} {requirement}, got {getattr(self, name)!r}")

        from pyengine.logits_processors.loading import check_processor_specs

        object.__setattr__(self, "logits_processors", check_processor_specs(self.logits_processors))

        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        check_executor_settings(self)
        from pyengine.kv_events.config import parse_kv_events_config

        kv_events = parse_kv_events_config(self.kv_events_config)
        # Kept as the checked, complete dict: plain data that crosses to a core process as JSON.
        object.__setattr__(self, "kv_events_config", None if kv_events is None else dataclasses.asdict(kv_events))
        if kv_events is not None and kv_events.active:
            from pyengine.kv_events.config import check_rank_ports

            check_rank_ports(kv_events, self.data_parallel_size)
        if kv_events is not None and kv_events.enable_kv_cache_events and not self.enable_prefix_caching:
            raise InvalidConfigError("kv_events_config: 'enable_kv_cache_events' needs enable_prefix_caching "
                                     "(the events describe the prefix cache), got enable_prefix_caching=False")
        need(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0")
        need(self.pipeline_depth in (1, 2), "pipeline_depth", "must be 1 or 2")
        need(isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1, "data_parallel_size",
             "must be an integer >= 1")
        need(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
             "tensor_parallel_size", "must be an integer >= 1")
        need(not (str(self.device).startswith("cuda") and self.data_parallel_size > 1 and self.tensor_parallel_size > 1),
             "data_parallel_size", "above 1 cannot be combined with tensor_parallel_size above 1 on CUDA yet "
             "(every engine core's ranks would take the same devices)")
        need(self.distributed_executor_backend in ("mp", "external_launcher"), "distributed_executor_backend",
             "must be 'mp' or 'external_launcher'")
        need(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "must be 'fcfs' or 'priority'")
        need(self.task in TASKS, "task", "must be 'auto', 'generate' or 'embed'")
        need(self.runner in RUNNERS, "runner", "must be 'auto', 'generate' or 'pooling'")
        _check_generation_config(self.generation_config)
        for name in ("revision", "download_dir", "tokenizer_revision"):
            need(getattr(self, name) is None or isinstance(getattr(self, name), (str, Path)), name,
                 "must be a string")
        _check_tokenizer(self.tokenizer)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        _check_speculation(self)
        if self.max_model_len is not None:
            need(self.max_num_batched_tokens >= min(self.max_num_seqs, self.max_model_len),
                 "max_num_batched_tokens", f"must be >= max_num_seqs ({self.max_num_seqs})")
        else:
            need(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                 f"must be >= max_num_seqs ({self.max_num_seqs})")
        if self.model is not None and self.load_format != "dummy":
            path = Path(self.model)
            if not (path / "config.json").is_file() and not _is_gguf_file(path):
                from pyengine.models.hub import looks_like_hub_id

                if looks_like_hub_id(self.model):
                    raise InvalidConfigError(
                        f"model {self.model!r} is not a checkpoint folder; it looks like a Hugging Face hub id, "
                        "which EngineConfig.from_kwargs (LLM, pyengine serve) resolves to a local snapshot"
                    )
                raise InvalidConfigError(
                    f"model {str(self.model)!r} is not a checkpoint folder (no config.json there); "
                    "pyengine loads local Hugging Face checkpoint folders and GGUF files (*.gguf)"
                )

    @property
    def kv_events(self) -> Optional[KVEventsConfig]:
        """``kv_events_config`` as its dataclass (None when not given)."""
        from pyengine.kv_events.config import KVEventsConfig

        return None if self.kv_events_config is None else KVEventsConfig(**self.kv_events_config)

    def executor_config(self) -> ExecutorConfig:
        """The executor's settings: every ExecutorConfig field, taken by name from here."""
        return ExecutorConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ExecutorConfig)})

    def scheduler_config(
        self, num_blocks: int, block_size: int, max_model_len: int,
        kv_groups: Sequence[tuple[Optional[int], int]] = (), group_tables: bool = False,
    ) -> SchedulerConfig:
        """The scheduler's settings, once the runner has decided the KV cache (its blocks and
        their size) and the model's length is known; ``kv_groups`` are the runner's layers by
        attention need (none given: full attention, every block kept); ``group_tables``: the
        runner's cache is laid out for a hybrid model's per-group block tables."""
        return SchedulerConfig(
            num_blocks,
            block_size=block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_kv_events=self.kv_events is not None and self.kv_events.active,
            policy=self.scheduling_policy,
            pipeline_depth=self.pipeline_depth,
            kv_groups=list(kv_groups),
            group_tables=group_tables,
            **_speculative_fields(self.speculative_config),
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

        tokenizer = kwargs.get("tokenizer")
        if looks_like_hub_id(model) or looks_like_hub_id(tokenizer):
            # every other argument's error before any download
            cls(model=None, **{**kwargs, "tokenizer": None if looks_like_hub_id(tokenizer) else tokenizer})
        resolved = resolve_model(model, revision=kwargs.get("revision"), cache_dir=kwargs.get("download_dir"),
                                 need_weights=kwargs.get("load_format", "auto") != "dummy")
        if tokenizer is not None:
            # vLLM's tokenizer=model means the model's own tokenizer: the resolved folder.
            kwargs["tokenizer"] = str(resolved) if str(tokenizer) == str(model) else str(resolve_model(
                str(tokenizer), revision=kwargs.get("tokenizer_revision"), cache_dir=kwargs.get("download_dir"),
                what="tokenizer"))
        model = resolved
        config = cls(model=model, **kwargs)
        if config.trust_remote_code:
            _warn_about_remote_code(config.model)
        return config


def _speculative_fields(spec: Optional[SpeculativeConfig]) -> dict[str, Any]:
    """The scheduler's speculative keyword arguments (none when speculation is off, so a
    scheduler without them still takes the rest)."""
    return {} if spec is None else spec.scheduler_fields()


def _check_speculation(config: EngineConfig) -> None:
    """What speculative decoding cannot be combined with (yet), refused by name."""
    spec = config.speculative_config
    if spec is None:
        return
    if not _scheduler_speculates():
        raise InvalidConfigError(
            "speculative decoding needs the scheduler's support for drafts (issue 24), which this build's native "
            "scheduler does not have yet: leave speculative_config unset"
        )


def _scheduler_speculates() -> bool:
    """The native scheduler takes the speculative fields (docs/speculative_decoding.md)."""
    try:
        SchedulerConfig(16, block_size=16, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=16,
                        num_speculative_tokens=0)
    except TypeError:
        return False
    return True


def _is_gguf_file(path: Path) -> bool:
    from pyengine.models.quantization.gguf_file import is_gguf_file

    return is_gguf_file(path)


def _check_generation_config(value: Any) -> None:
    """"auto", "vllm", or a folder holding a generation_config.json."""
    if value in ("auto", "vllm"):
        return
    if not isinstance(value, (str, Path)) or not (Path(value).expanduser() / "generation_config.json").is_file():
        raise InvalidConfigError(
            f"generation_config must be 'auto', 'vllm' or a folder holding a generation_config.json, got {value!r}"
        )


def _check_tokenizer(tokenizer: Any) -> None:
    """None, or a folder with a tokenizer.json (a hub id is resolved by ``from_kwargs`` first)."""
    if tokenizer is None:
        return
    if not isinstance(tokenizer, (str, Path)):
        raise InvalidConfigError(f"tokenizer must be a folder or a hub id, got {tokenizer!r}")
    folder = Path(tokenizer).expanduser()
    if (folder / "tokenizer.json").is_file():
        return
    from pyengine.models.hub import looks_like_hub_id

    if looks_like_hub_id(str(tokenizer)):
        raise InvalidConfigError(f"tokenizer {str(tokenizer)!r} is not a folder; it looks like a Hugging Face hub id, "
                                 "which EngineConfig.from_kwargs (LLM, pyengine serve) resolves to a local snapshot")
    what = "has no tokenizer.json" if folder.is_dir() else "is not a folder"
    raise InvalidConfigError(f"tokenizer {str(tokenizer)!r} {what}: pyengine reads a tokenizer from a folder's "
                             "tokenizer.json (the fast tokenizer format that transformers saves)")


def _warn_about_remote_code(model: Optional[Union[str, Path]]) -> None:
    """trust_remote_code=True: pyengine runs no checkpoint code; say so when the checkpoint has some."""
    if model is None:
        return
    try:
        auto_map = json.loads((Path(model) / "config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return
    if auto_map:
        logger.warning(
            "trust_remote_code=True: the checkpoint %s ships its own code (auto_map in config.json); pyengine never "
            "runs remote code and loads it with its built-in implementation of the architecture", model
        )
