"""The built-in logits processors and the batch layout they see, against references
nobody here wrote (transformers' ``SequenceBiasLogitsProcessor`` and
``NoBadWordsLogitsProcessor``) or exact logits arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.processor_batch import ProcessorBatch
from pyengine.logits_processors import (
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    BatchUpdate,
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
)
from pyengine.logits_processors.index_state import move_rows, update_entries
from pyengine.logits_processors.interface import MoveDirectionality
from pyengine.sampling_params import SamplingParams

VOCAB = 64
CPU = torch.device("cpu")
CONFIG = ExecutorConfig(max_num_seqs=8)


def _added(params_list, outputs=None):
    outputs = outputs or [[] for _ in params_list]
    return BatchUpdate(len(params_list), [], [(i, p, [1, 2], o) for i, (p, o) in enumerate(zip(params_list, outputs))], [])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    processor = MinTokensLogitsProcessor(CONFIG, CPU, False, eos_token_ids=(3,))
    processor.update_state(_added([
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=0, stop_token_ids=[5]),
    ]))
    logits = torch.zeros(3, VOCAB)
    logits[:, 3], logits[:, 5], logits[:, 7] = 3.0, 2.0, 1.0
    picks = []
    for _ in range(3):
        processor.update_state(None)
        out = processor.apply(logits.clone())
        picks.append(out.argmax(-1).tolist())
        processor.record_sampled(out.argmax(-1))
    assert picks == [[7, 3, 3], [7, 3, 3], [3, 3, 3]]


def test_min_tokens_counts_a_resumed_requests_outputs():
    processor = MinTokensLogitsProcessor(CONFIG, CPU, False, eos_token_ids=(3,))
    processor.update_state(_added([SamplingParams(min_tokens=3)], outputs=[[9, 9, 9]]))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    assert processor.apply(logits.clone()).argmax().item() == 3  # 3 outputs already: may stop


def test_logit_bias_matches_transformers_sequence_bias():
    rng = np.random.default_rng(0)
    biases = [{int(t): float(b) for t, b in zip(rng.choice(VOCAB, 5, replace=False), rng.uniform(-100, 100, 5))}
              for _ in range(3)]
    params = [SamplingParams(logit_bias=biases[0]), SamplingParams(), SamplingParams(logit_bias=biases[2])]
    processor = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    processor.update_state(_added(params))
    logits = torch.randn(3, VOCAB)
    got = processor.apply(logits.clone())
    for row, bias in enumerate([biases[0], {}, biases[2]]):
        expected = logits[row : row + 1].clone()
        if bias:
            reference = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
            expected = reference(torch.tensor([[1, 2]]), expected)
        torch.testing.assert_close(got[row : row + 1], expected)


def test_allowed_token_ids_leave_only_those_tokens():
    processor = AllowedTokenIdsLogitsProcessor(CONFIG, CPU, False)
    processor.update_state(_added([SamplingParams(), SamplingParams(allowed_token_ids=[4, 9, 9, 60])]))
    logits = torch.randn(2, VOCAB)
    got = processor.apply(logits.clone())
    torch.testing.assert_close(got[0], logits[0])
    expected = torch.full((VOCAB,), float("-inf"))
    expected[[4, 9, 60]] = logits[1, [4, 9, 60]]
    torch.testing.assert_close(got[1], expected)


def test_bad_words_match_transformers_on_random_histories():
    rng = np.random.default_rng(1)
    words = [[7], [3, 4], [3, 5], [1, 2, 3], [8, 8]]
    processor = BadWordsLogitsProcessor(CONFIG, CPU, False)
    rows = 6
    histories = [rng.integers(1, 9, int(rng.integers(0, 6))).tolist() for _ in range(rows)]
    params = [SamplingParams(_bad_words_token_ids=words if r != 2 else None) for r in range(rows)]
    processor.update_state(_added(params, outputs=[list(h) for h in histories]))
    reference = NoBadWordsLogitsProcessor(words)
    for _ in range(25):
        logits = torch.randn(rows, VOCAB)
        logits[:, 1:9] += 3.0  # keep sampling from the small alphabet the words use
        got = processor.apply(logits.clone())
        for r, history in enumerate(histories):
            if r == 2:
                torch.testing.assert_close(got[r], logits[r])
                continue
            # transformers looks at the whole input; give it only the outputs, as vLLM does.
            expected = reference(torch.tensor([[0] + history]), logits[r : r + 1].clone())[0]
            torch.testing.assert_close(got[r], expected)
        sampled = got.argmax(-1)
        processor.record_sampled(sampled)
        for r in range(rows):
            histories[r].append(int(sampled[r]))


def _apply_as_vllm(entries: dict, update, row_of) -> None:
    """What a processor written for vLLM does with ``update``: removed, added, then the
    ``moved`` list one entry at a time (a SWAP trades, a UNIDIRECTIONAL move leaves ``a``
    empty)."""
    if update is None:
        return
    for index in update.removed:
        entries.pop(index, None)
    for index, params, _, _ in update.added:
        entries[index] = row_of(params)
    for a, b, direction in update.moved:
        moving, other = entries.pop(a, None), entries.pop(b, None)
        if moving is not None:
            entries[b] = moving
        if other is not None:
            assert direction is MoveDirectionality.SWAP, f"({a}, {b}) is one-way but {b} is taken"
            entries[a] = other


def _layout_model_check(batch: ProcessorBatch, update, entries: dict, reference: dict, sample_rows: list[int],
                        live: set):
    """Applying ``update`` to a per-index dict of rows leaves index i holding the i-th
    sampled row, and every live row at one index below ``batch_size``: through the
    built-ins' helper (the permutation) and through vLLM's ``moved`` list alike."""
    update_entries(entries, update, lambda params, prompt, outputs: params.extra_args["row"])
    _apply_as_vllm(reference, update, lambda params: params.extra_args["row"])
    for state in (entries, reference):
        assert [state.get(i) for i in range(len(sample_rows))] == sample_rows
        assert sorted(state.values()) == sorted(live)
        assert all(0 <= i < len(live) for i in state)
    assert entries == reference
    if update is not None:
        assert update.batch_size == len(live)


def test_batch_layout_follows_random_installs_frees_and_sample_orders():
    """Model-based: random installs, frees and step orders, checked against a plain dict
    updated with the vLLM processing order (removed, added, moved)."""
    rng = np.random.default_rng(7)
    max_rows = 12
    batch = ProcessorBatch(max_rows)
    entries: dict[int, int] = {}
    reference: dict[int, int] = {}
    live: set[int] = set()
    for _ in range(400):
        free = [r for r in range(max_rows) if r not in live]
        for row in rng.choice(free, int(rng.integers(0, min(3, len(free)) + 1)), replace=False).tolist():
            batch.install(row, SamplingParams(extra_args={"row": row}), [1], [])
            live.add(row)
        if live and rng.random() < 0.4:
            gone = rng.choice(sorted(live), int(rng.integers(1, min(3, len(live)) + 1)), replace=False)
            batch.free(np.array(gone))
            live -= set(gone.tolist())
        sampling = [r for r in rng.permutation(sorted(live)).tolist() if rng.random() < 0.8]
        update = batch.step(np.array(sampling, dtype=np.int32))
        _layout_model_check(batch, update, entries, reference, sampling, live)


def test_a_request_leaving_the_front_is_one_permutation():
    """The batch's first request leaves: every other index shifts by one. The update
    carries it as one permutation (what the built-ins apply in one copy per table);
    a row that does not sample and already sits past the sampled ones is not moved."""
    batch = ProcessorBatch(8)
    for row in range(6):
        batch.install(row, SamplingParams(), [], [])
    batch.step(np.array([0, 1, 2, 3, 4]))  # row 5 holds state, samples nothing: index 5
    batch.free(np.array([0]))
    update = batch.step(np.array([1, 2, 3, 4]))
    assert update.removed == [0] and update.batch_size == 5
    assert update.permutation.tolist() == [1, 2, 3, 4, 5]
    table = np.array([10, 11, 12, 13, 14, 15, 16, 17])
    move_rows(update, table)
    assert table[:5].tolist() == [11, 12, 13, 14, 15]
    batch.install(6, SamplingParams(), [], [])
    update = batch.step(np.array([1, 2, 3, 4, 5, 6]))  # the new row takes the next index: nothing moves
    assert update.added[0][0] == 5 and update.permutation is None and not update.moved
    update = batch.step(np.array([1, 2, 3]))  # rows 4, 5, 6 sample nothing and sit past them: they stay
    assert update.permutation is None and not update.moved
    update = batch.step(np.array([2, 1]))  # one swap; the four rows past them stay
    assert update.permutation.tolist() == [1, 0, 2, 3, 4, 5]
    assert list(update.moved) == [(1, 0, MoveDirectionality.SWAP)]


def test_steady_decode_produces_no_update():
    batch = ProcessorBatch(4)
    for row in (3, 1):
        batch.install(row, SamplingParams(), [], [])
    assert batch.step(np.array([3, 1])) is not None
    assert batch.step(np.array([3, 1])) is None
    update = batch.step(np.array([1, 3]))
    assert update is not None and update.moved and not update.added


def test_processors_follow_moves_and_removals():
    """Two biased requests, one finishing and a new one taking its place: each index
    keeps its own request's bias after the layout moves."""
    batch = ProcessorBatch(4)
    processor = LogitBiasLogitsProcessor(CONFIG, CPU, False)
    bias = {row: SamplingParams(logit_bias={10 + row: 50.0}) for row in range(4)}
    for row in (0, 1, 2):
        batch.install(row, bias[row], [], [])
    orders = [[0, 1, 2], [2, 0, 1], [2, 1], [3, 2, 1]]
    for step, order in enumerate(orders):
        if step == 2:
            batch.free(np.array([0]))
        if step == 3:
            batch.install(3, bias[3], [], [])
        processor.update_state(batch.step(np.array(order)))
        got = processor.apply(torch.zeros(len(order), VOCAB)).argmax(-1).tolist()
        assert got == [10 + row for row in order]


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    (dict(bad_words=["ok", ""]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(bad_words=["w"] * 129), "bad_words"),
    (dict(extra_args={1: 2}), "extra_args"),
])
def test_bad_processor_fields_are_refused_naming_the_field(kwargs, field):
    from pyengine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


class _Counting:
    """A processor that counts its calls; argmax-invariant or not, failing on demand."""

    instances: list["_Counting"] = []

    def __init__(self, invariant: bool, fail: bool = False) -> None:
        self.invariant, self.fail = invariant, fail
        self.applied, self.updates = 0, []
        _Counting.instances.append(self)

    def is_argmax_invariant(self):
        return self.invariant

    def update_state(self, update):
        self.updates.append(update)

    def apply(self, logits):
        self.applied += 1
        if self.fail:
            raise RuntimeError("boom")
        return logits

    def record_sampled(self, token_ids):
        pass


def test_argmax_invariant_processors_are_skipped_only_in_all_greedy_steps():
    from pyengine.executor.logits_pipeline import LogitsPipeline

    pipeline = LogitsPipeline([lambda: _Counting(True), lambda: _Counting(False)], 4)
    invariant, other = pipeline.processors
    pipeline.install(0, SamplingParams(), [1], [])
    pipeline.process(torch.zeros(1, VOCAB), np.array([0]), greedy_only=True)
    assert (invariant.applied, other.applied) == (0, 1)
    pipeline.process(torch.zeros(1, VOCAB), np.array([0]), greedy_only=False)
    assert (invariant.applied, other.applied) == (1, 2)
    assert len(invariant.updates) == 2  # its state is kept up to date either way


def test_a_failed_pipeline_rebuilds_its_processors_with_every_request_added():
    from pyengine.executor.logits_pipeline import LogitsPipeline

    fail = {"now": True}
    pipeline = LogitsPipeline([lambda: _Counting(False, fail=fail["now"])], 4)
    for row in (2, 0):
        pipeline.install(row, SamplingParams(extra_args={"row": row}), [1], [7])
    with pytest.raises(RuntimeError, match="boom"):
        pipeline.process(torch.zeros(2, VOCAB), np.array([2, 0]), greedy_only=False)
    pipeline.record_sampled(torch.tensor([5, 6]), np.array([5, 6]))
    fail["now"] = False
    broken = pipeline.processors[0]
    pipeline.process(torch.zeros(1, VOCAB), np.array([0]), greedy_only=False)
    fresh = pipeline.processors[0]
    assert fresh is not broken and fresh.applied == 1
    (update,) = fresh.updates
    by_index = {index: (params.extra_args["row"], outputs) for index, params, _, outputs in update.added}
    assert by_index == {0: (0, [7, 6]), 1: (2, [7, 5])} and update.batch_size == 2


def test_built_ins_follow_random_churn_of_the_batch():
    """Model-based: random installs, frees and sample orders through the whole pipeline;
    each request allows only its own token and EOS (which min_tokens forbids), so the
    processed logits of sample i must leave exactly that request's token."""
    from pyengine.executor.logits_pipeline import LogitsPipeline

    rng = np.random.default_rng(11)
    max_rows = 10
    pipeline = LogitsPipeline.build(ExecutorConfig(max_num_seqs=max_rows), CPU, eos_token_ids=(1,))
    live: set[int] = set()
    for _ in range(300):
        free = [r for r in range(max_rows) if r not in live]
        for row in rng.choice(free, int(rng.integers(0, min(3, len(free)) + 1)), replace=False).tolist():
            pipeline.install(row, SamplingParams(allowed_token_ids=[10 + row, 1], min_tokens=10**6,
                                                 max_tokens=None), [5], [])
            live.add(row)
        if live and rng.random() < 0.4:
            gone = rng.choice(sorted(live), int(rng.integers(1, min(3, len(live)) + 1)), replace=False)
            pipeline.free(np.array(gone))
            live -= set(gone.tolist())
        sampling = np.array([r for r in rng.permutation(sorted(live)).tolist() if rng.random() < 0.8], dtype=np.int32)
        logits = pipeline.process(torch.zeros(len(sampling), VOCAB), sampling, greedy_only=False)
        assert torch.isfinite(logits).sum(-1).tolist() == [1] * len(sampling)
        assert logits.argmax(-1).tolist() == [10 + r for r in sampling.tolist()]
        tokens = torch.tensor([10 + r for r in sampling.tolist()], dtype=torch.int64)
        pipeline.record_sampled(tokens, tokens.numpy())
