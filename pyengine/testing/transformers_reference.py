"""What Hugging Face transformers computes on a checkpoint folder (float32, CPU): the
reference that tests hold pyengine's logits and greedy tokens to. transformers is
imported on the first call, not with this module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def reference_model(folder: Path, *, ignore_eos: bool = True) -> Any:
    """transformers' model of the checkpoint in ``folder`` (float32, eval mode); with
    ``ignore_eos`` its ``generate`` runs past the checkpoint's EOS."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    return model


def reference_logits(folder: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of ``prompt`` for the checkpoint in ``folder``."""
    reference = reference_model(folder)
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits[0]


def reference_greedy_tokens(folder: Path, prompts: list[list[int]], max_tokens: int, *,
                            ignore_eos: bool = True) -> list[list[int]]:
    """transformers' greedy ``generate`` (float32) of each prompt: the new tokens, up to
    ``max_tokens``; past the checkpoint's EOS (``ignore_eos``) or stopping at it."""
    reference = reference_model(folder, ignore_eos=ignore_eos)
    with torch.no_grad():
        return [reference.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
