"""The routed experts' two products on CPU: one product per expert that received rows,
through the native skinny kernels on decode-sized groups.

``GroupedExperts`` (``experts.py``) sorts the step's (token, expert) rows by expert once;
:func:`run_experts` then multiplies each expert's contiguous block of rows by that
expert's gate/up weight, applies ``silu(gate) * up`` to all rows in one operator, and
multiplies each block by the expert's down weight. A block of up to ``gemv.MAX_ROWS``
float32 rows (a decode step: batch 64, top-2 of 8 experts gives about 16 rows per
expert) goes to the native kernels (``_kernels.gemv_f32``, ``rust_sched/kernels``),
which read the expert's weight once, as loaded ([out, in], no copy), and write straight
into the block's rows of the layer's output (numpy views taken once per layer, no
per-expert allocation); wider blocks (prefill) go to ``torch.mm`` on the same weight.
Quantized experts (``quantization="int8"`` / ``"int4"``) are row slices of one stacked
``PackedWeight`` per projection: ``_kernels.gemv_quantized`` on decode-sized blocks,
dequantize-then-matmul (``reference_matmul``) on wider ones.

Why not ``torch._grouped_mm`` on CPU: PyTorch 2.15's CPU implementation is a loop of
``mm`` over the groups; it is fast only on input-major copies of the weights
(``[E, in, out]``; twice as slow on views of the checkpoint's layout), and the native
kernels, float and quantized, read the checkpoint's layout: one layout serves both. On
``benches/moe_layer.py``'s layer (2 cores under heavy load) the two paths took the same
time within the noise; at 1024 prefill tokens a loop of ``mm`` on the loaded layout took
what ``_grouped_mm`` on the copies did (92 vs 94 ms). The loop runs over the experts that
got rows (one host read of the counts per layer), never over tokens.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import _kernels
from pyengine.models import gemv
from pyengine.models.quantization.packed import PackedWeight, QuantizationError, reference_matmul


class ExpertMatmuls(Protocol):
    """Each expert's block of ``x`` (``sizes[e]`` rows, in expert order) times that
    expert's gate/up ([2I, H]) or down ([H, I]) weight, written into the same rows of ``out``."""

    def gate_up(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None: ...

    def down(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None: ...


class FloatExpertMatmuls:
    """Products with float weights ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (views of
    the loaded parameters, built per call: nothing is cached that loading could change)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self._gate_up = gate_up.detach()
        self._down = down.detach()

    def gate_up(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        _float_products(self._gate_up, sizes, x, out)

    def down(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        _float_products(self._down, sizes, x, out)


class QuantizedExpertMatmuls:
    """Products with packed experts: ``gate_up`` [E * 2I, H] and ``down`` [E * H, I]
    PackedWeights, stacked as the float parameters are (expert e's rows are block e), so
    each expert's weight is a row slice (a view, no copy)."""

    def __init__(self, gate_up: PackedWeight, down: PackedWeight, num_experts: int) -> None:
        for weight in (gate_up, down):
            if weight.out_features % num_experts:
                raise QuantizationError(
                    f"packed experts of {weight.out_features} rows do not split into {num_experts} experts"
                )
            if weight.input_perm is not None:
                raise QuantizationError("packed experts cannot have an input_perm (act-order)")
        self.gate_up_weight = gate_up
        self.down_weight = down
        self._gate_up = _PackedExperts(gate_up, num_experts)
        self._down = _PackedExperts(down, num_experts)

    @property
    def nbytes(self) -> int:
        return self.gate_up_weight.nbytes + self.down_weight.nbytes

    def gate_up(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        self._gate_up.products(sizes, x, out)

    def down(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        self._down.products(sizes, x, out)


def run_experts(
    rows: torch.Tensor, counts: torch.Tensor, matmuls: ExpertMatmuls, intermediate: int, hidden: int
) -> torch.Tensor:
    """``down_e(silu(gate_e(r)) * up_e(r))`` for every row ``r`` of ``rows`` [R, H],
    grouped by expert (``counts`` [E] rows each, in expert order): [R, hidden]."""
    sizes = counts.tolist()  # the one host read of the layer
    rows = rows.contiguous()
    gate_up = rows.new_empty(rows.shape[0], 2 * intermediate)
    matmuls.gate_up(sizes, rows, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    activated = F.silu(gate) * up
    out = rows.new_empty(rows.shape[0], hidden)
    matmuls.down(sizes, activated, out)
    return out


def _expert_blocks(sizes: list[int]) -> Iterator[tuple[int, int, int]]:
    """(expert, start, end) for each expert that received rows: rows ``start:end`` of the
    expert-sorted input are that expert's block (``sizes[e]`` rows each, in expert order)."""
    start = 0
    for expert, size in enumerate(sizes):
        if size:
            yield expert, start, start + size
            start += size


def _native_rows(x: torch.Tensor) -> bool:
    """Whether ``x``'s blocks may go to the native kernels (float32 CPU, contiguous, widths
    of whole chunks); each block also needs at most ``gemv.MAX_ROWS`` rows."""
    return (
        x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and not x.requires_grad
        and x.shape[1] % gemv.CHUNK == 0
    )


def _float_products(weights: torch.Tensor, sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
    native = _native_rows(x) and weights.dtype == torch.float32 and weights.is_contiguous()
    if native:
        w, xs, outs, threads = weights.numpy(), x.numpy(), out.numpy(), torch.get_num_threads()
    for expert, start, end in _expert_blocks(sizes):
        if native and end - start <= gemv.MAX_ROWS:
            _kernels.gemv_f32(outs[start:end], xs[start:end], w[expert], threads)
        else:
            torch.mm(x[start:end], weights[expert].t(), out=out[start:end])


class _PackedExperts:
    """One stacked PackedWeight cut into its experts: the native kernels' numpy views per
    expert where they take the format, and each expert's PackedWeight for the wide path."""

    def __init__(self, weight: PackedWeight, num_experts: int) -> None:
        rows = weight.out_features // num_experts
        self.parts = [weight.rows(expert * rows, rows) for expert in range(num_experts)]
        self.group_size = weight.group_size
        self.native = gemv.weight_fits(weight) and all(
            t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in (weight.qweight, weight.scales,
                                                                                 weight.biases)
        )
        self.arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = [
            (p.qweight.numpy(), p.scales.numpy(), None if p.biases is None else p.biases.numpy())
            for p in self.parts
        ] if self.native else []

    def products(self, sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        native = self.native and _native_rows(x)
        if native:
            xs, outs, threads = x.numpy(), out.numpy(), torch.get_num_threads()
        for expert, start, end in _expert_blocks(sizes):
            if native and end - start <= gemv.MAX_ROWS:
                qweight, scales, biases = self.arrays[expert]
                _kernels.gemv_quantized(outs[start:end], xs[start:end], qweight, scales, biases, self.group_size,
                                        threads)
            else:
                out[start:end] = reference_matmul(x[start:end], self.parts[expert])
