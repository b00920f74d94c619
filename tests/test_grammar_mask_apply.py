"""The executor's half of grammar masks: packed words unpacked on the device exactly as
numpy's unpackbits reads them, only the constrained rows masked, a bounded wait."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.executor.grammar_mask import GrammarMaskApplier


class _Ticket:
    def __init__(self, bits: np.ndarray) -> None:
        self.bits = bits

    def take(self, timeout: float):
        return self.bits, 0.001


class _Plan:
    def __init__(self, bits: np.ndarray, indices: list[int]) -> None:
        self.grammar_mask = _Ticket(bits)
        self.mask_sample_indices = np.array(indices, dtype=np.int32)


def reference_allowed(bits: np.ndarray, vocab: int) -> np.ndarray:
    as_bytes = bits.astype("<u4").view(np.uint8).reshape(bits.shape[0], -1)
    unpacked = np.unpackbits(as_bytes, axis=1, bitorder="little").astype(bool)
    out = np.zeros((bits.shape[0], vocab), dtype=bool)
    width = min(vocab, unpacked.shape[1])
    out[:, :width] = unpacked[:, :width]
    return out


@pytest.mark.parametrize("vocab", [100, 128, 200])
def test_unpack_matches_numpy(vocab):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=(5, 4), dtype=np.uint64).astype(np.uint32)  # 128 token ids
    got = GrammarMaskApplier(torch.device("cpu")).unpack(bits, vocab)
    assert got.dtype == torch.bool and got.shape == (5, vocab)
    assert np.array_equal(got.numpy(), reference_allowed(bits, vocab))


def test_only_the_constrained_rows_are_masked():
    logits = torch.randn(4, 64)
    original = logits.clone()
    bits = np.zeros((2, 2), dtype=np.uint32)
    bits[0, 0] = 0b1010  # row 1 of the step: tokens 1 and 3
    bits[1, 1] = 1 << 31  # row 3 of the step: token 63
    applier = GrammarMaskApplier(torch.device("cpu"))
    out = applier.apply(_Plan(bits, [1, 3]), logits)
    assert out is logits
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [63]
    assert torch.equal(logits[1, [1, 3]], original[1, [1, 3]])
    summary = applier.summary()
    assert summary["steps"] == 1 and 0.0 <= summary["hidden_fraction"] <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_native_kernel_and_the_tensor_path_agree_with_numpy(dtype):
    """float32 on CPU goes through the native kernel, float64 through the tensor ops."""
    rng = np.random.default_rng(1)
    vocab = 150
    bits = rng.integers(0, 2**32, size=(3, 4), dtype=np.uint64).astype(np.uint32)  # 128 ids wide
    bits[1, 2] = 0xFFFFFFFF
    logits = torch.randn(5, vocab, dtype=dtype)
    original = logits.clone()
    GrammarMaskApplier(torch.device("cpu")).apply(_Plan(bits, [4, 0, 2]), logits)
    allowed = reference_allowed(bits, vocab)
    expected = original.clone()
    for i, row in enumerate([4, 0, 2]):
        expected[row, ~torch.from_numpy(allowed[i])] = float("-inf")
    assert torch.equal(logits, expected)


def test_the_kernel_refuses_rows_outside_the_logits():
    from pyengine import KernelError
    from pyengine._kernels import apply_token_bitmask

    with pytest.raises(KernelError, match="outside the 2 rows"):
        apply_token_bitmask(np.zeros((2, 8), np.float32), np.zeros((1, 1), np.uint32), np.array([2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_narrower_than_the_mask(dtype):
    """A mask wider than the logits (its last word padded past the vocabulary): bits past
    the logits are ignored, on the native kernel and on the tensor path."""
    rng = np.random.default_rng(2)
    vocab = 100
    bits = rng.integers(0, 2**32, size=(2, 4), dtype=np.uint64).astype(np.uint32)  # 128 ids wide
    bits[1] = 0
    bits[1, 3] = 1 << 30  # row 1 allows token 126 only: past the logits, so nothing there
    logits = torch.randn(3, vocab, dtype=dtype)
    original = logits.clone()
    GrammarMaskApplier(torch.device("cpu")).apply(_Plan(bits, [2, 0]), logits)
    allowed = reference_allowed(bits, vocab)
    expected = original.clone()
    for i, row in enumerate([2, 0]):
        expected[row, ~torch.from_numpy(allowed[i])] = float("-inf")
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[0]).all() and torch.equal(logits[1], original[1])


def _real_ticket_plan(pipeline_depth: int):
    """A scheduler (no model) and a constrained plan whose ticket is the scheduler's own."""
    from pyengine import Request, Scheduler, SchedulerConfig
    from pyengine._sched import GrammarCompiler

    compiler = GrammarCompiler([b"a", b"b", b"<eos>"], [], [2], 40)
    s = Scheduler(SchedulerConfig(16, block_size=4, max_model_len=64, pipeline_depth=pipeline_depth))
    s.add_request(Request("r", [0], max_tokens=5, constraint=compiler.compile("regex", "a+")))
    return s, s.schedule()


def test_a_mask_that_does_not_come_fails_apply_in_bounded_time_and_leaves_the_logits(monkeypatch):
    from pyengine import StepResultError
    from pyengine.executor import grammar_mask

    monkeypatch.setattr(grammar_mask, "MASK_TIMEOUT_S", 0.05)
    s, first = _real_ticket_plan(pipeline_depth=2)
    second = s.schedule()  # its mask waits for the first step's result, which never comes
    first.grammar_mask.take(1.0)
    logits = torch.randn(1, 40)
    original = logits.clone()
    applier = GrammarMaskApplier(torch.device("cpu"))
    with pytest.raises(StepResultError, match="did not arrive within 0.05 s"):
        applier.apply(second, logits)
    assert torch.equal(logits, original) and applier.summary() == {"steps": 0}


def test_a_mask_whose_scheduler_is_gone_fails_apply_with_engine_dead():
    import gc

    from pyengine import EngineDeadError

    s, first = _real_ticket_plan(pipeline_depth=2)
    second = s.schedule()
    first.grammar_mask.take(1.0)
    del s
    gc.collect()
    logits = torch.randn(1, 40)
    original = logits.clone()
    with pytest.raises(EngineDeadError, match="dropped the step's grammar mask"):
        GrammarMaskApplier(torch.device("cpu")).apply(second, logits)
    assert torch.equal(logits, original)


def test_a_failed_mask_reports_only_the_constrained_rows():
    """``mask_isolated`` (what the model runner calls): the mask's failure names the
    constrained samples, and the other rows' logits are untouched."""
    from pyengine.executor.row_isolation import mask_isolated

    class _Lost:
        step_id = 7
        mask_sample_indices = np.array([1, 3], dtype=np.int32)

        class grammar_mask:  # noqa: N801 - stands for the ticket attribute
            @staticmethod
            def take(timeout):
                raise TimeoutError("injected")

    logits = torch.randn(4, 16)
    original = logits.clone()
    failed = []
    mask_isolated(GrammarMaskApplier(torch.device("cpu")), _Lost(), logits, lambda i, e: failed.append((i, str(e))))
    assert failed == [(1, "injected"), (3, "injected")] and torch.equal(logits, original)
