"""vLLM's ``LLM`` methods that pyengine does not have, as methods that say so.

A script ported from vLLM that calls one of these gets an ``InvalidRequestError`` naming
the method and what to use instead, rather than an ``AttributeError`` that reads like a
typo. ``LLM`` inherits them; each is one line of text here.
"""

from __future__ import annotations

from typing import Any, NoReturn

from pyengine.errors import InvalidRequestError

_INSTEAD = {
    "classify": "pyengine has no classification heads; LLM.embed gives pooled vectors to classify with",
    "score": "pyengine has no cross-encoder scoring; compare LLM.embed vectors (cosine similarity) instead",
    "reward": "pyengine has no reward-model heads; LLM.embed gives the pooled hidden states",
    "sleep": "pyengine does not offload weights; call LLM.shutdown() and build a new LLM later",
    "wake_up": "pyengine does not offload weights; build a new LLM",
    "start_profile": "use torch.profiler around LLM.generate, or LLM.stats() for the engine's figures",
    "stop_profile": "use torch.profiler around LLM.generate, or LLM.stats() for the engine's figures",
    "collective_rpc": "pyengine runs no user functions on its workers",
    "apply_model": "pyengine runs no user functions on its model",
}


def _unsupported(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise InvalidRequestError(f"LLM.{name} is not supported: {_INSTEAD[name]}")

    method.__name__ = name
    method.__doc__ = f"Not supported (vLLM has it): raises InvalidRequestError. {_INSTEAD[name]}."
    return method


class UnsupportedVllmMethods:
    """The methods of ``_INSTEAD``, each raising ``InvalidRequestError`` that says what to do."""

    classify = _unsupported("classify")
    score = _unsupported("score")
    reward = _unsupported("reward")
    sleep = _unsupported("sleep")
    wake_up = _unsupported("wake_up")
    start_profile = _unsupported("start_profile")
    stop_profile = _unsupported("stop_profile")
    collective_rpc = _unsupported("collective_rpc")
    apply_model = _unsupported("apply_model")
