"""pyengine: an LLM inference engine core.

A Rust scheduler thread plans every batch and accounts every KV block with the GIL
released; a PyTorch executor thread runs the forward passes; an output thread turns
tokens into text. See the README and ``docs/`` for the map.
"""

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
from pyengine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineError,
    InvalidConfigError,
    InvalidRequestError,
    StepResultError,
    UnknownRequestError,
)

__all__ = [
    "__version__",
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
]
