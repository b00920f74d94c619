"""The executor's prompt-logprobs bookkeeping across a request's life: entries for the
right positions chunk by chunk, nothing asked once the prompt's last position was
computed, and nothing recomputed for a sequence back from a preemption (it holds outputs,
so every prompt entry was delivered before)."""

from __future__ import annotations

import numpy as np

from pyengine import SamplingParams
from pyengine.executor.plan import HandBuiltPlan
from pyengine.executor.prompt_logprobs import PromptLogprobsTable

I32 = np.int32
I64 = np.int64


def plan(step: int, row: int, start: int, count: int, install: list[int] | None = None,
         num_prompt: int = 0, params: SamplingParams | None = None) -> HandBuiltPlan:
    """One row scheduled for positions start .. start + count - 1 (installed with tokens
    ``install``, of which the first ``num_prompt`` are the prompt)."""
    new = install is not None
    tokens = np.asarray(install or [], dtype=I64)
    return HandBuiltPlan(
        step_id=step, rows=np.array([row], dtype=I32), num_scheduled_tokens=np.array([count], dtype=I32),
        query_start_loc=np.array([0, count], dtype=I32), seq_lens=np.array([start + count], dtype=I32),
        input_ids=np.full(count, -1, dtype=I64), positions=np.arange(start, start + count, dtype=I64),
        slot_mapping=np.arange(count, dtype=I64), logits_indices=np.array([count - 1], dtype=I64),
        sample_rows=np.array([row], dtype=I32), pool_indices=np.zeros(0, dtype=I32),
        block_table_rows=np.zeros(0, dtype=I32), block_table_cols=np.zeros(0, dtype=I32),
        block_table_ids=np.zeros(0, dtype=I32), new_rows=np.array([row] if new else [], dtype=I32),
        new_seq_ids=np.array([7] if new else [], dtype=np.uint64),
        new_num_prompt_tokens=np.array([num_prompt] if new else [], dtype=I32),
        new_token_offsets=np.array([0, len(tokens)] if new else [0], dtype=I64), new_token_ids=tokens,
        new_params=[params] if new else [], freed_rows=np.zeros(0, dtype=I32),
    )


def test_entries_chunk_by_chunk_then_nothing_once_the_prompt_is_done():
    table = PromptLogprobsTable(4, 512)
    prompt = [10, 11, 12, 13, 14, 15]
    asked = SamplingParams(prompt_logprobs=2)
    first = table.job(plan(0, 1, 0, 4, install=prompt, num_prompt=6, params=asked))
    assert first.first_positions.tolist() == [1] and first.targets.tolist() == [11, 12, 13, 14]
    second = table.job(plan(1, 1, 4, 2))
    # Position 5 is the sampled one: only prompt token 5's entry (from position 4) is left.
    assert second.first_positions.tolist() == [5] and second.targets.tolist() == [15]
    assert 1 not in table.prompts and table.requested[1] == -1  # done: no decode step looks at it
    assert table.job(plan(2, 1, 6, 1)) is None


def test_a_sequence_back_from_a_preemption_is_not_asked_again():
    table = PromptLogprobsTable(4, 512)
    prompt = [10, 11, 12, 13]
    asked = SamplingParams(prompt_logprobs=0)
    # Resumed: the prompt and the two outputs it had, recomputed from position 0.
    resumed = plan(0, 2, 0, 6, install=prompt + [40, 41], num_prompt=4, params=asked)
    assert table.job(resumed) is None and not table.prompts
    # The same prompt, never run before: asked.
    fresh = table.job(plan(1, 3, 0, 4, install=prompt, num_prompt=4, params=asked))
    assert fresh is not None and fresh.targets.tolist() == [11, 12, 13]


def test_a_one_token_prompt_is_never_asked_about():
    table = PromptLogprobsTable(4, 512)
    assert table.job(plan(0, 0, 0, 1, install=[9], num_prompt=1, params=SamplingParams(prompt_logprobs=1))) is None
    assert not table.prompts
