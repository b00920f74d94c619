"""Runs beam searches on an engine: the step loop shared by the offline API (``LLM``) and
the asyncio one (``EngineClient``), and the checks both make first.

A step collects the live beams of every search into one batch of engine requests (one
token each, the top ``candidates`` log-probabilities, greedy so they are the model's own)
and hands each search its results. The requests hold the whole sequence as their prompt:
the prefix cache serves the blocks the beam shares with its parent (and the prompt), so a
step computes only each beam's last, partial block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Optional

from pyengine.beam_search.outputs import BeamSearchOutput
from pyengine.beam_search.params import BeamSearchParams
from pyengine.beam_search.search import BeamSearch
from pyengine.errors import EngineError, InvalidRequestError
from pyengine.inputs.prompts import PromptType, normalize_prompt
from pyengine.logprobs import Logprob
from pyengine.outputs import RequestOutput
from pyengine.sampling_params import SamplingParams

#: A step's batch: the sequences to extend, and the parameters of their engine requests.
Batch = tuple[list[list[int]], SamplingParams]
Candidates = Mapping[int, Logprob]  # token id -> its log-probability


def check_params(params: BeamSearchParams, max_logprobs: int, num_eos: int) -> None:
    """``InvalidRequestError`` naming the field when the engine cannot run this search: each
    step asks ``max(2, 1 + num_eos) * beam_width`` log-probabilities per beam."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidRequestError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    params.validate()  # fields may have been set after construction
    factor = max(2, 1 + (0 if params.ignore_eos else num_eos))
    if factor * params.beam_width > max_logprobs:
        raise InvalidRequestError(
            f"beam_width must be <= {max_logprobs // factor}, got {params.beam_width}: each step asks the engine "
            f"for {factor} * beam_width log-probabilities per beam, and its max_logprobs is {max_logprobs}")


def make_searches(prompts: Sequence[PromptType], params: BeamSearchParams, tokenize: Callable[[str], list[int]],
                  eos_token_ids: Sequence[int], max_request_tokens: int) -> tuple[list[Optional[str]], list[BeamSearch]]:
    """The prompts' texts (None for token ids) and one search per prompt. Every prompt is
    normalized and checked before any step: none empty, each leaving room in
    ``max_request_tokens`` for a generated token. The searches hold a copy of ``params``:
    later changes to the caller's object do not reach a running search."""
    normalized = [normalize_prompt(p, tokenize) for p in prompts]
    for _, ids in normalized:
        if not ids:
            raise InvalidRequestError("a prompt is empty (0 tokens)")
        if len(ids) >= max_request_tokens:
            raise InvalidRequestError(f"a prompt has {len(ids)} tokens; this engine holds {max_request_tokens} per "
                                      "sequence, so it leaves no room for a generated token")
    params = dataclasses.replace(params)
    searches = [BeamSearch(ids, params, eos_token_ids, max_tokens=max_request_tokens - len(ids))
                for _, ids in normalized]
    return [text for text, _ in normalized], searches


def step_params(search: BeamSearch) -> SamplingParams:
    """One token, and the top log-probabilities the search needs, per beam. Greedy unless a
    temperature is set (the log-probabilities are then those of the tempered logits)."""
    return SamplingParams(n=1, max_tokens=1, temperature=search.params.temperature, logprobs=search.candidates,
                          ignore_eos=True, detokenize=False)


def search_steps(searches: Sequence[BeamSearch]) -> Generator[Batch, list[Candidates], None]:
    """Yields each step's batch and takes its results (``send``), one dict per sequence in
    batch order, until every search is done."""
    if not searches:
        return
    params = step_params(searches[0])
    while True:
        sequences: list[list[int]] = []
        counts = []
        for search in searches:
            pending = search.pending()
            sequences.extend(pending)
            counts.append(len(pending))
        if not sequences:
            return
        results = yield sequences, params
        start = 0
        for search, count in zip(searches, counts):
            if count:
                search.advance(results[start:start + count])
                start += count


def run_steps(searches: Sequence[BeamSearch], evaluate: Callable[[Batch], list[Candidates]],
              on_step: Optional[Callable[[], None]] = None) -> None:
    """Runs ``searches`` to the end, ``evaluate`` computing each step's batch."""
    steps = search_steps(searches)
    try:
        batch = next(steps)
        while True:
            results = evaluate(batch)
            if on_step is not None:
                on_step()
            batch = steps.send(results)
    except StopIteration:
        pass


def candidates_of(output: RequestOutput) -> Candidates:
    """The next-token log-probabilities an engine request of a step returned."""
    completion = output.outputs[0] if output.outputs else None
    if completion is None or not completion.logprobs:
        reason = completion.finish_reason if completion is not None else None
        raise EngineError(f"a beam-search step ended without a token (finish_reason {reason!r})")
    return completion.logprobs[0]


def finish(searches: Sequence[BeamSearch], prompts: Sequence[Optional[str]],
           decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
    """Each search's best sequences with their text."""
    outputs = []
    for search, prompt in zip(searches, prompts):
        sequences = search.results()
        for sequence in sequences:
            sequence.text = decode(search.text_tokens(sequence))
        outputs.append(BeamSearchOutput(sequences, prompt, list(search.prompt_token_ids)))
    return outputs
