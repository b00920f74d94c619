"""Prompt normalisation: what users pass (text, token ids, vLLM-style dicts) into
``(text or None, token ids)`` pairs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional, Union

from pyengine.errors import InvalidRequestError

TokensPrompt = dict  # {"prompt_token_ids": [...]} or {"prompt": "..."}, as in vLLM
PromptType = Union[str, list[int], TokensPrompt]


def is_single_prompt(prompts: object) -> bool:
    """True for one prompt (text, token-id list or dict), False for a list of them."""
    if isinstance(prompts, (str, dict)):
        return True
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return True
    return False


def normalize_prompt(prompt: PromptType, tokenize: Callable[[str], list[int]]) -> tuple[Optional[str], list[int]]:
    if isinstance(prompt, str):
        return prompt, tokenize(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], tokenize(prompt["prompt"])
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, Sequence):
        return None, _ids(prompt)
    raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _ids(ids: Sequence[int]) -> list[int]:
    out = []
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise InvalidRequestError(f"prompt token ids must be non-negative ints, got {t!r}")
        out.append(int(t))
    return out
