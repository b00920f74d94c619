"""``greedy_tokens`` (numpy's argmax on CPU float32 logits) gives torch's argmax: ties to
the first index, NaN and infinities as torch orders them, any row count and stride."""

from __future__ import annotations

import pytest
import torch

from pyengine.models.greedy import greedy_tokens


def _same(logits: torch.Tensor) -> None:
    got, want = greedy_tokens(logits), logits.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.device == logits.device and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("rows", [1, 2, 7, 33])
def test_random_rows_match_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    _same(torch.randn(rows, 151_936, generator=gen))


def test_ties_nan_and_infinities_match_torch():
    logits = torch.zeros(6, 64)
    logits[0, [5, 9, 40]] = 3.0  # a three-way tie: the first
    logits[1, 7] = float("nan")  # NaN counts as the largest
    logits[1, 2] = float("inf")
    logits[2, [4, 11]] = float("inf")
    logits[3] = float("-inf")  # every logit masked: index 0
    logits[4, [3, 8]] = float("nan")
    logits[5, 63] = 1e-30
    _same(logits)


def test_strided_one_dimensional_and_other_dtypes():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(8, 300, generator=gen)
    _same(wide[::2, 10:250])  # a strided view
    _same(wide[3])  # one row as a vector: a 0-d answer
    _same(wide.to(torch.bfloat16))  # torch's own path
    _same(wide.to(torch.float64))
    grad = wide.clone().requires_grad_(True)
    assert torch.equal(greedy_tokens(grad), wide.argmax(dim=-1))
