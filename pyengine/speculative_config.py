"""``speculative_config``: speculative decoding's engine argument, in vLLM v1's shape.

Users pass a dict (``LLM(model, speculative_config={"method": "ngram",
"num_speculative_tokens": 4})``) or, on the command line, its JSON
(``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'``); it becomes
one frozen :class:`SpeculativeConfig`, checked once here, with messages that name the key
at fault. vLLM's keys keep their meaning; a key pyengine does not implement is refused by
name rather than ignored, so a config never silently means less than it says.

What each method maps to in the scheduler (docs/speculative_decoding.md): "ngram" and
"suffix" are proposed by the Rust scheduler itself; "draft_model" (a second, smaller model
sharing the target's vocabulary) and "eagle3" (an EAGLE-3 head reading the target's hidden
states) by the executor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from pyengine.errors import InvalidConfigError

METHODS = ("ngram", "suffix", "draft_model", "eagle3")
# vLLM's other methods, refused by name (not "unknown").
_OTHER_VLLM_METHODS = ("eagle", "medusa", "mlp_speculator", "mtp", "deepseek_mtp")
# Drafts per step at most: each is a verified position of the step's forward.
MAX_SPECULATIVE_TOKENS = 32
# vLLM's prompt-lookup default when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding's settings (vLLM v1's keys).

    - ``method``: "ngram" (prompt lookup: the continuation of the last n-gram's earlier
      occurrence in the sequence), "suffix" (the longest earlier match of the sequence's
      suffix), "draft_model" (a smaller checkpoint, ``model``), "eagle3" (an EAGLE-3 head
      checkpoint as published, ``model``). Without ``method``, a ``model`` means
      "draft_model", as in vLLM.
    - ``num_speculative_tokens``: drafts proposed per sequence and step (k, 1 to 32).
    - ``prompt_lookup_min`` / ``prompt_lookup_max``: n-gram lengths tried, longest
      first ("ngram" only). vLLM's defaults: both 5 when neither is given, else the
      missing one equals the other.
    - ``model``: the draft checkpoint folder ("draft_model") or the EAGLE-3 head's
      ("eagle3"); either must share the target's vocabulary (checked when it loads).
    - ``draft_tensor_parallel_size``: vLLM's key; only 1 (or unset) is accepted.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None
    draft_tensor_parallel_size: Optional[int] = None

    def __post_init__(self) -> None:
        def bad(key: str, requirement: str) -> InvalidConfigError:
            return InvalidConfigError(f"speculative_config: {key} {requirement}, got {getattr(self, key)!r}")

        if self.method in _OTHER_VLLM_METHODS:
            raise InvalidConfigError(f"speculative_config: method {self.method!r} is not supported by pyengine "
                                     f"(supported: {', '.join(METHODS)})")
        if self.method not in METHODS:
            raise bad("method", f"must be one of {', '.join(repr(m) for m in METHODS)}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise bad("draft_tensor_parallel_size", "must be 1 (a draft model is not split over ranks)")
        if self.method == "ngram":
            self._default_lookup()
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, key)
                if not _is_int(value) or value < 1:
                    raise bad(key, "must be an integer >= 1")
            if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
                raise bad("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise bad(key, "applies to method 'ngram' only")
        if self.proposed_by_executor:
            if not isinstance(self.model, (str, Path)) or not (Path(self.model) / "config.json").is_file():
                raise bad("model", f"must be a checkpoint folder (with a config.json) for method {self.method!r}")
            object.__setattr__(self, "model", str(self.model))
        elif self.model is not None:
            raise bad("model", f"does not apply to method {self.method!r}")

    def _default_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        object.__setattr__(self, "prompt_lookup_min", high if low is None else low)
        object.__setattr__(self, "prompt_lookup_max", low if high is None else high)

    @property
    def proposed_by_executor(self) -> bool:
        """Drafts come from the executor with each step's result (a draft model, an EAGLE-3 head)."""
        return self.method in ("draft_model", "eagle3")

    def scheduler_fields(self) -> dict[str, Any]:
        """The scheduler's keyword arguments (docs/speculative_decoding.md)."""
        fields: dict[str, Any] = {
            "num_speculative_tokens": self.num_speculative_tokens,
            "speculative_method": "executor" if self.proposed_by_executor else self.method,
        }
        if self.method == "ngram":
            fields["prompt_lookup_min"] = self.prompt_lookup_min
            fields["prompt_lookup_max"] = self.prompt_lookup_max
        return fields

    @classmethod
    def from_value(cls, value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """None, a SpeculativeConfig, a dict of vLLM's keys, or its JSON (the command line)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise InvalidConfigError(f"speculative_config is not valid JSON ({error}): {value!r}") from None
        if not isinstance(value, dict):
            raise InvalidConfigError(f"speculative_config must be a dict (or its JSON), got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidConfigError(f"speculative_config: unknown or unsupported key(s) {', '.join(unknown)} "
                                     f"(supported: {', '.join(sorted(known))})")
        fields = dict(value)
        if fields.get("method") is None and fields.get("model") is not None:
            fields["method"] = "draft_model"  # vLLM's inference from a model alone
        for key in ("method", "num_speculative_tokens"):
            if fields.get(key) is None:
                raise InvalidConfigError(f"speculative_config: {key} is required")
        return cls(**fields)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
