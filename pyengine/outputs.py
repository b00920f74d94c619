"""What callers get back, with vLLM's names so code moves over by changing an import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pyengine.logprob_arrays import LOGPROB_FLOOR, LogprobArrays
from pyengine.logprobs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = [
    "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "EngineHealth", "EngineStats", "Logprob",
    "LOGPROB_FLOOR", "OutputKind", "PromptLogprobs", "RequestMetrics", "RequestOutput", "SampleLogprobs",
    "ThreadStack",
]

# "cumulative": every update carries everything so far; "delta": only what is new;
# "final": one output when the request has finished.
OutputKind = Literal["cumulative", "delta", "final"]


@dataclass
class CompletionOutput:
    """One sample of a generation request.

    ``logprobs`` is vLLM's list of ``{token id: Logprob}`` maps. The engine hands over its
    arrays (``logprob_arrays``, see ``logprob_arrays.py``) and the maps are built from them
    the first time ``logprobs`` is read: a caller who never reads them (the server reads the
    arrays) never pays for them.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error", "dead_end" (grammar)
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it

    #: The engine's arrays ``logprobs`` is built from, as the engine made the output (None
    #: when not asked for, or for an output made with maps). Not a field: a plain attribute
    #: that ``with_logprob_arrays`` sets, so reading it on the hot path is one lookup.
    logprob_arrays = None  # Optional[LogprobArrays]

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __getstate__(self) -> dict[str, Any]:
        return _state_with_maps(self, "logprobs")


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The state of a generation request: cumulative, or the latest delta when streaming
    deltas (``text`` and ``token_ids`` then hold only what is new)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    #: With ``SamplingParams.prompt_logprobs``: see :data:`PromptLogprobs` (a delta output
    #: carries them once, in the first output that has them). Built on first read from
    #: ``prompt_logprob_arrays`` (positions 1.., the first prompt token having none).
    prompt_logprobs: Optional[PromptLogprobs] = None
    #: The engine's arrays ``prompt_logprobs`` is built from: one position per prompt token
    #: after the first (None when not asked for, or for an output made with maps; see
    #: ``CompletionOutput.logprob_arrays``).
    prompt_logprob_arrays = None  # Optional[LogprobArrays]

    def __getstate__(self) -> dict[str, Any]:
        return _state_with_maps(self, "prompt_logprobs")


class _MapsFromArrays:
    """``logprobs`` / ``prompt_logprobs`` of an output the engine made with its arrays
    (``with_logprob_arrays``): the maps are built on the first read and kept from then on
    as the plain attribute (a non-data descriptor, as ``functools.cached_property``). An
    output made with maps, or None, holds them as a plain attribute and never comes here:
    building outputs costs nothing more when no log-probabilities were asked for."""

    def __init__(self, name: str, arrays: str, first: list[None]) -> None:
        self.name = name
        self.arrays = arrays  # the attribute holding the arrays
        self.first = first  # what comes before the arrays' positions: [None] for a prompt's first token

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return None  # the class attribute: the field's default
        arrays = obj.__dict__.get(self.arrays)
        maps = obj.__dict__[self.name] = None if arrays is None else [*self.first, *arrays.to_dicts()]
        return maps


def with_logprob_arrays(output: Any, arrays: LogprobArrays) -> Any:
    """``output`` (a ``CompletionOutput`` or a ``RequestOutput``, made with no log-probability
    maps) carrying the engine's ``arrays``: ``logprobs`` / ``prompt_logprobs`` are built from
    them when first read."""
    state = output.__dict__
    if isinstance(output, CompletionOutput):
        state.pop("logprobs", None)
        state["logprob_arrays"] = arrays
    else:
        state.pop("prompt_logprobs", None)
        state["prompt_logprob_arrays"] = arrays
    return output


def _state_with_maps(obj: Any, name: str) -> dict[str, Any]:
    """A pickled output carries the maps, not the arrays (their ``piece`` holds a tokenizer)."""
    getattr(obj, name)  # built now if they were not yet
    state = dict(obj.__dict__)
    state.pop("logprob_arrays" if name == "logprobs" else "prompt_logprob_arrays", None)
    return state


CompletionOutput.logprobs = _MapsFromArrays("logprobs", "logprob_arrays", [])  # type: ignore[assignment]
RequestOutput.prompt_logprobs = _MapsFromArrays("prompt_logprobs", "prompt_logprob_arrays",  # type: ignore[assignment]
                                                [None])


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The result of an embedding (pooling) request."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: Optional[RequestMetrics] = None


# What one request's stream yields: a generation's outputs or an embedding's.
AnyOutput = Union[RequestOutput, EmbeddingRequestOutput]


@dataclass
class EngineStats:
    """A snapshot of the engine: enough to tell which thread is the bottleneck.

    ``threads`` maps the thread name to busy and idle seconds (idle = blocked waiting for
    work); ``scheduler`` holds the native scheduler's figures (queue lengths, KV usage,
    prefix-cache and token counters, plan times); ``pipeline_bubble_s`` is the time the
    executor waited for a plan while requests were live.
    """

    threads: dict[str, dict[str, float]]
    steps: int
    step_time_mean_ms: float
    step_time_p99_ms: float
    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    preemptions: int
    kv_usage: float
    kv_blocks_total: int
    prefix_cache_hit_rate: float
    prompt_tokens: int
    generated_tokens: int
    queue_depths: dict[str, int]
    # Numbers, and per-position lists (speculative decoding's accepted tokens by position).
    scheduler: dict[str, Union[float, list[float]]] = field(default_factory=dict)
    # Executor waits for a plan while requests were live (pipeline bubbles).
    pipeline_bubble_s: float = 0.0
    pipeline_bubbles: int = 0


@dataclass(frozen=True)
class EngineHealth:
    """One look at whether the engine is serving and moving, for /health's watchdog.

    ``steps`` only grows (executor steps finished); the watchdog calls the engine stalled
    when it stays put while ``num_unfinished`` requests wait. Plain data, so that a client
    in another process can hand it over as it is."""

    dead_reason: Optional[str]  # why the engine can no longer serve; None while it can
    steps: int
    num_unfinished: int

    @property
    def alive(self) -> bool:
        return self.dead_reason is None


@dataclass(frozen=True)
class ThreadStack:
    """One engine thread as the stall watchdog logs it: ``role`` is "scheduler",
    "executor" or "output"; ``stack`` holds ``traceback.format_stack`` lines, None for a
    native thread (the Rust scheduler has no Python frames) or one that is not running."""

    name: str
    role: str
    native: bool
    native_id: Optional[int] = None
    stack: Optional[list[str]] = None
