"""oneDNN sees few distinct row counts: every packed linear pads its rows to
``padded_rows(m)``, so the primitives oneDNN builds and caches (one per shape) stay few
however many token counts a server's steps have (issue 11, item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pyengine
from pyengine.models import cpu_linear, gemv
from pyengine.models.loader import load_model
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.contiguous_reference import ContiguousKVCache, contiguous_step

needs_onednn = pytest.mark.skipif(
    not cpu_linear.can_pack(torch.ones(1)), reason="this PyTorch build has no oneDNN"
)


def test_padded_rows_are_few_and_close():
    sizes = [cpu_linear.padded_rows(m) for m in range(0, 8193)]
    assert sizes[:9] == list(range(9))  # small steps (decode) run unpadded
    assert all(m <= p <= 1.25 * m for m, p in enumerate(sizes))
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))
    assert all(cpu_linear.padded_rows(p) == p for p in sizes)
    assert len(set(sizes[1:])) == 48
    assert len(set(sizes[1:257])) == 28


@needs_onednn
@pytest.mark.parametrize("rows", [*range(1, 40), 63, 65, 129, 300, 1025])
def test_padded_matmuls_equal_dense(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, other_weight = torch.randn(48, 24, generator=gen), torch.randn(48, 24, generator=gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(rows, 24, generator=gen)
    packed, other_packed = cpu_linear.pack(weight), cpu_linear.pack(other_weight)
    got = cpu_linear.linear(x, packed, bias)
    assert got.shape == (rows, 48) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, bias))
    gate = cpu_linear.linear_silu(x, packed)
    torch.testing.assert_close(gate, F.silu(F.linear(x, weight)))
    torch.testing.assert_close(cpu_linear.linear_times(x, other_packed, gate), F.linear(x, other_weight) * gate)
    transposed = torch.randn(24, rows, generator=gen).T  # not contiguous
    torch.testing.assert_close(cpu_linear.linear(transposed, packed), F.linear(transposed, weight))
    # A packed linear's output fed to the next one (as in the MLP) reuses its padded rows.
    chained = cpu_linear.linear(cpu_linear.linear(x, packed), cpu_linear.pack(torch.randn(24, 48, generator=gen)))
    assert chained.shape == (rows, 24)


@needs_onednn
def test_model_steps_reach_onednn_only_with_padded_row_counts(tmp_path, monkeypatch):
    model = load_model(make_tiny_checkpoint(tmp_path / "m", "qwen2")).model
    model.pack_for_cpu()
    seen: set[int] = set()
    for name in ("_pointwise", "_binary"):
        real = getattr(cpu_linear, name)

        def spy(x, *args, _real=real):
            seen.add(x.shape[0])
            return _real(x, *args)

        monkeypatch.setattr(cpu_linear, name, spy)
    gen = torch.Generator().manual_seed(0)
    for batch, length in ((1, 1), (3, 7), (2, 23), (5, 13), (1, 77)):
        cache = ContiguousKVCache(model, batch, 128)
        prefill = contiguous_step(model, cache, torch.randint(0, 512, (batch, length), generator=gen))
        contiguous_step(model, cache, prefill.argmax(-1, keepdim=True))
    # Steps up to gemv.MAX_ROWS rows (the decode steps, the small prefills) run the native
    # skinny kernels; the wider ones reach oneDNN padded.
    assert seen and all(m > gemv.MAX_ROWS for m in seen)
    assert 65 not in seen and 80 in seen  # a 65-token prefill (5 x 13) ran on 80 rows
    assert all(cpu_linear.padded_rows(m) == m for m in seen)


def test_only_cpu_linear_calls_onednn_linears():
    """The padding lives in cpu_linear: no other module may call oneDNN's linear directly."""
    root = Path(pyengine.__file__).parent
    callers = [path.relative_to(root).as_posix() for path in root.rglob("*.py")
               if "_linear_pointwise" in path.read_text()]
    assert callers == ["models/cpu_linear.py"]
