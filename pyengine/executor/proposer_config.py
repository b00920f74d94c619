"""What can be refused of a draft model or an EAGLE-3 head from its ``config.json``
alone, before any weight is loaded.

The proposers check it again when they load (``draft_proposer``, ``eagle3_proposer``);
tensor parallelism checks it first, before any worker starts (``tensor_parallel.runner.
start``): rank 0 loads the proposer while the workers wait for it in a collective, so a
proposer refused only then would keep them waiting until they are stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyengine.errors import InvalidConfigError
from pyengine.models.config import DecoderConfig
from pyengine.models.eagle3_config import read_eagle3_config
from pyengine.models.loader import read_model_config


def check_proposer_config(spec: Any, target: DecoderConfig) -> None:
    """``spec``'s draft model or EAGLE-3 head against the ``target`` it drafts for
    (nothing for the scheduler's methods or speculation off)."""
    if spec is None or not spec.proposed_by_executor:
        return
    if spec.method == "eagle3":
        read_eagle3_config(Path(spec.model), target)
    else:
        check_draft_config(read_model_config(spec.model), target)


def check_draft_config(draft: DecoderConfig, target: DecoderConfig) -> None:
    """A draft model's token ids must mean the target's (the same vocabulary size; the
    tokenizers are compared when both load), and its attention must be one the proposer
    runs (not latent attention)."""
    if draft.vocab_size != target.vocab_size:
        raise InvalidConfigError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size} "
                                 f"tokens) is not the target's ({target.vocab_size}): a draft model must share "
                                 "the target's vocabulary")
    if draft.mla is not None:
        raise InvalidConfigError("speculative_config: a draft model with latent attention (DeepSeek MLA) is not "
                                 "supported yet")
