"""The exceptions pyengine raises, all rooted at ``EngineError``. The native modules raise
these same classes."""

from __future__ import annotations

__all__ = [
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


class EngineError(Exception):
    """Base class of every error pyengine raises on purpose."""


class InvalidConfigError(EngineError, ValueError):
    """An engine argument is out of range or inconsistent; the message names it."""


class InvalidRequestError(EngineError, ValueError):
    """A request that can never be served (too long, empty, bad token ids...)."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that is still in use."""


class UnknownRequestError(EngineError, LookupError):
    """A request or sequence id the engine never issued."""


class StepResultError(EngineError):
    """A step result that does not match the plan it answers (an executor bug)."""


class EngineDeadError(EngineError):
    """The engine (or one of its threads) has stopped; the message says why."""


class KernelError(EngineError, ValueError):
    """A native CPU kernel refused its arguments (shapes, layout, aliasing)."""


class ModelLoadError(EngineError, ValueError):
    """A checkpoint that cannot be loaded: missing files, unsupported architecture,
    weights that do not match the config."""


class KVCacheTooSmallError(EngineError, ValueError):
    """The memory budget leaves fewer KV blocks than one request of max_model_len needs."""


class AttentionBackendUnavailableError(EngineError, RuntimeError):
    """The requested attention backend cannot run on this device or dtype."""


class NativePanicError(EngineError, RuntimeError):
    """A panic inside pyengine's Rust core, caught where Python calls it (a bug: the message
    says where). Raised instead of pyo3's ``PanicException``, which derives from
    ``BaseException`` and escapes ``except Exception``; the object that panicked may be
    left broken (a scheduler thread that panics marks the engine dead)."""
