"""A stand-in executor that verifies drafts greedily, for tests of speculative decoding's
scheduler half (the real verification is the model runner's, ``docs/speculative_decoding.md``).

Its "model" is :func:`markov_token`: the next token is a function of the input token and
its position only (the twin of the scheduler crate's ``sim::markov_token``), mostly a
fixed permutation of a small vocabulary, so outputs repeat and prompt lookup finds them,
shifted every seventh position, so some drafts are rejected. A sequence's output is then
the same whatever the drafts, the batching and the preemptions: a run with speculation
must produce exactly the tokens of a run without. Each entry gets a log-probability that
names its token (``-token / 1000``), so tests can check that the output thread picks the
row of the token it emits.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from pyengine.executor.plan import PLACEHOLDER_TOKEN, last_sample_per_row
from pyengine.executor.runner_output import LogprobsOutput, ModelRunnerOutput
from pyengine.testing.synthetic_runner import SleepRunner


def markov_token(inputs: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    """The token after ``inputs`` at ``positions`` (the positions of the new tokens)."""
    nxt = (inputs * 5 + 3) % vocab
    return np.where(positions % 7 == 0, (nxt + 1) % vocab, nxt)


class GreedySpecRunner(SleepRunner):
    """A ``SleepRunner`` whose tokens follow :func:`markov_token` over the first ``vocab``
    ids, verifying each sequence's drafts greedily (accepted while each equals the model's
    token before it), with log-probabilities for every element of ``sampled``."""

    def __init__(self, vocab: int = 40, **kwargs: Any) -> None:
        super().__init__(0.0, **kwargs)
        self.vocab = vocab
        rows = kwargs.get("max_rows", 4096)
        self.last = np.zeros(rows, dtype=np.int64)
        self.row_seq = np.full(rows, -1, dtype=np.int64)
        self.drafted_steps = 0

    def execute(self, plan: Any) -> ModelRunnerOutput:
        self.row_seq[plan.new_rows] = plan.new_seq_ids.astype(np.int64)
        ids = np.asarray(plan.input_ids, dtype=np.int64).copy()
        holes = np.flatnonzero(ids == PLACEHOLDER_TOKEN)
        if holes.size:
            owners = np.searchsorted(plan.query_start_loc, holes, side="right") - 1
            ids[holes] = self.last[plan.rows[owners]]
        idx = np.asarray(plan.logits_indices, dtype=np.int64)
        targets = markov_token(ids[idx], np.asarray(plan.positions)[idx] + 1, self.vocab)
        counts = np.asarray(plan.num_draft_tokens, dtype=np.int64)
        num_accepted: Optional[np.ndarray] = None
        if counts.size:
            self.drafted_steps += 1
            sampled, accepted, entry, at = [], [], 0, 0
            for d in counts.tolist():
                drafts = plan.draft_token_ids[at:at + d]
                a = 0
                while a < d and drafts[a] == targets[entry + a]:
                    a += 1
                sampled += [int(t) for t in drafts[:a]] + [int(targets[entry + a])]
                accepted.append(a)
                entry, at = entry + d + 1, at + d
            out = np.array(sampled, dtype=np.int64)
            num_accepted = np.array(accepted, dtype=np.int32)
        else:
            out = targets.astype(np.int64)
        rows, last = last_sample_per_row(plan, out, num_accepted)
        self.last[rows] = last
        values = (-out / 1000.0).astype(np.float32)
        logprobs = LogprobsOutput(out[:, None].copy(), values[:, None].copy(), values,
                                  np.ones(len(out), dtype=np.int64), np.ones(len(out), dtype=np.int64))
        seq_rows = np.asarray(plan.sample_rows)
        if counts.size:  # one element of `sampled` per accepted draft + 1, per sequence
            per_seq = seq_rows[np.cumsum(counts + 1) - 1]
            seq_rows = np.repeat(per_seq, num_accepted.astype(np.int64) + 1)
        return ModelRunnerOutput(plan.step_id, out, sampled_seq_ids=self.row_seq[seq_rows], logprobs=logprobs,
                                 num_accepted=num_accepted)
