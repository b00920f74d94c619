"""Which rows a proposer with a cache of its own keeps up (``proposals.rows_to_mirror``) and
its every-step shortcut (``proposals.mirrors_any``): the two agree on every kind of step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pyengine.executor.proposals import mirrors_any, rows_to_mirror


def _plan(chunks: list[tuple[int, int, int]], may_draft) -> SimpleNamespace:
    """``chunks``: (row, first position, tokens) per scheduled row."""
    counts = [n for _, _, n in chunks]
    return SimpleNamespace(
        rows=np.array([r for r, _, _ in chunks], dtype=np.int64),
        query_start_loc=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        positions=np.concatenate([np.arange(p, p + n) for _, p, n in chunks]).astype(np.int64),
        **({} if may_draft is None else {"may_draft_indices": np.asarray(may_draft, dtype=np.int64)}),
    )


PROMPT_LEN = np.array([10, 20, 5, 7], dtype=np.int64)


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("chunks, may_draft", [
    ([(0, 30, 1), (1, 40, 1)], []),  # decode rows past their prompts, nobody drafts: nothing
    ([(0, 10, 1), (1, 40, 1)], []),  # row 0's first decode token: its pair (shift 1) is in the prompt
    ([(0, 30, 1), (1, 40, 1)], [1]),  # a sequence that may draft
    ([(2, 0, 5), (3, 30, 1)], []),  # a prefill chunk
    ([(2, 3, 4), (3, 30, 4)], []),  # chunks of several tokens, the first in its prompt
    ([(2, 6, 4), (3, 30, 4)], []),  # chunks past the prompts (verification entries)
    ([(0, 30, 1)], None),  # a hand-built plan without the field: every row
])
def test_mirrors_any_agrees_with_rows_to_mirror(chunks, may_draft, shift):
    plan = _plan(chunks, may_draft)
    assert mirrors_any(plan, PROMPT_LEN, shift) == bool(rows_to_mirror(plan, PROMPT_LEN, shift).any())


def test_mirrors_any_on_random_steps():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        rows = rng.choice(4, size=int(rng.integers(1, 5)), replace=False)
        chunks = [(int(r), int(rng.integers(0, 30)), int(rng.integers(1, 4)) if rng.random() < 0.5 else 1)
                  for r in rows]
        may = [] if rng.random() < 0.7 else [int(rng.integers(0, len(rows)))]
        plan = _plan(chunks, may)
        expected = bool(rows_to_mirror(plan, PROMPT_LEN, 1).any())
        assert mirrors_any(plan, PROMPT_LEN, 1) == expected
        seen.add(expected)
    assert seen == {True, False}
