"""pyengine: an LLM inference engine core.

A Rust scheduler thread plans every batch and accounts every KV block with the GIL
released; a PyTorch executor thread runs the forward passes; an output thread turns
tokens into text. See the README and ``docs/architecture.md`` for the map.
"""

try:
    # The native extension; loading it registers the modules ``pyengine._sched`` and
    # ``pyengine._kernels``, bound here as the package's attributes too.
    from pyengine._native import _kernels, _sched  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - depends on how the package was installed
    if e.name != "pyengine._native":
        raise
    raise ImportError(
        f"pyengine's native extension (pyengine._native) is not in {__path__[0]}. This happens when "
        "Python imports the source folder (the repository root is the current directory or on "
        "sys.path) instead of the installed package. Build it in place with `make build-dev`, "
        "or run from another directory so the installed wheel is imported."
    ) from e

from pyengine._sched import (
    FINISH_REASONS,
    PLACEHOLDER_TOKEN,
    OutputEvent,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerThread,
    StepPlan,
    __version__,
)
from pyengine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pyengine.config import EngineConfig
from pyengine.errors import (
    AttentionBackendUnavailableError,
    DuplicateRequestError,
    EngineDeadError,
    EngineError,
    InvalidConfigError,
    InvalidRequestError,
    KernelError,
    KVCacheTooSmallError,
    ModelLoadError,
    NativePanicError,
    StepResultError,
    UnknownRequestError,
)
from pyengine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    EngineStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from pyengine.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams

# The engine classes import torch; load them on first use so that `import pyengine`
# stays light for scheduler-only use.
_LAZY = {
    "LLM": "pyengine.entrypoints.llm",
    "AsyncEngine": "pyengine.entrypoints.async_engine",
    "make_engine_client": "pyengine.entrypoints.client_factory",
    "LinkOptions": "pyengine.multiprocess.link_options",
    "LogitsProcessor": "pyengine.logits_processors",
    "BatchUpdate": "pyengine.logits_processors",
    "MoveDirectionality": "pyengine.logits_processors",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pyengine' has no attribute {name!r}")


__all__ = [
    "__version__",
    "LLM",
    "AsyncEngine",
    "make_engine_client",
    "LinkOptions",
    "EngineConfig",
    "SamplingParams",
    "PoolingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "LogitsProcessor",
    "BatchUpdate",
    "MoveDirectionality",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "EngineStats",
    "FINISH_REASONS",
    "PLACEHOLDER_TOKEN",
    "OutputEvent",
    "Request",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerThread",
    "StepPlan",
    "EngineError",
    "InvalidConfigError",
    "InvalidRequestError",
    "DuplicateRequestError",
    "UnknownRequestError",
    "StepResultError",
    "EngineDeadError",
    "KernelError",
    "ModelLoadError",
    "KVCacheTooSmallError",
    "AttentionBackendUnavailableError",
    "NativePanicError",
]
