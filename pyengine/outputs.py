"""What callers get back, with vLLM's names so code moves over by changing an import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from pyengine.logprobs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = [
    "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "EngineHealth", "EngineStats", "Logprob",
    "LOGPROB_FLOOR", "OutputKind", "PromptLogprobs", "RequestMetrics", "RequestOutput", "SampleLogprobs",
    "ThreadStack",
]

# "cumulative": every update carries everything so far; "delta": only what is new;
# "final": one output when the request has finished.
OutputKind = Literal["cumulative", "delta", "final"]


# Tokens that top-k / top-p / min-p excluded have a log-probability of -inf, which JSON
# cannot carry; like vLLM's server we report them as this floor. Here, not in the output
# thread's module, because both sides of the EngineClient interface read it.
LOGPROB_FLOOR = -9999.0


@dataclass
class CompletionOutput:
    """One sample of a generation request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error", "dead_end" (grammar)
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


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
    #: carries them once, in the first output that has them).
    prompt_logprobs: Optional[PromptLogprobs] = None


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
    scheduler: dict[str, float] = field(default_factory=dict)
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
