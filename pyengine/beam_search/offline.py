"""``LLM.beam_search``'s body: prompts in, one ``BeamSearchOutput`` per prompt out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from pyengine.beam_search.driver import Batch, Candidates, check_params, finish, make_searches, run_steps
from pyengine.beam_search.outputs import BeamSearchOutput
from pyengine.beam_search.params import BeamSearchParams
from pyengine.errors import InvalidRequestError
from pyengine.inputs.prompts import PromptType, is_single_prompt

if TYPE_CHECKING:
    from pyengine.engine.core import EngineCore


def run_offline(engine: EngineCore, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                evaluate: Callable[[Batch], list[Candidates]], use_tqdm: bool = False,
                concurrency_limit: Optional[int] = None) -> list[BeamSearchOutput]:
    """Beam search for each prompt, ``concurrency_limit`` prompts at a time (all at once by
    default); ``evaluate`` runs one step's batch on ``engine``."""
    check_params(params, engine.config.max_logprobs, len(engine.eos_token_ids))
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
        raise InvalidRequestError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}")
    items = [prompts] if is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item]
    texts, searches = make_searches(items, params, engine.tokenize, engine.eos_token_ids, engine.max_request_tokens)
    chunk = concurrency_limit or max(1, len(searches))
    bar = _progress_bar(len(searches)) if use_tqdm else None
    try:
        for start in range(0, len(searches), chunk):
            group = searches[start:start + chunk]
            run_steps(group, evaluate)
            if bar is not None:
                bar.update(len(group))
    finally:
        if bar is not None:
            bar.close()

    def decode(ids: list[int]) -> str:
        return engine.decode(ids, skip_special_tokens=False)

    return finish(searches, texts, decode)


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="beam search", unit="prompt", dynamic_ncols=True)
