"""Linear layers on CPU through oneDNN, with each weight packed once after loading.

``F.linear`` on CPU calls MKL's sgemm, which repacks the weight matrix into its blocked
layout on every call. A decode step multiplies a few dozen rows by each weight, so the
repacking is a large share of the matmul: for a ``[36, 256] x [256, 1536]`` product it
took 236 us against 168 us with a weight oneDNN packed in advance (2 cores, AVX-512).
oneDNN can also apply an activation or an elementwise product with another tensor
while the output is still in registers ("post-ops"), which saves the gated MLP two
passes over its ``[tokens, intermediate]`` activations (1.5x faster on 2048 tokens).

Packing is for float32 weights on CPU when PyTorch was built with oneDNN (the PyPI
wheels are). The packed tensor replaces the dense one: after packing, the layers call
``release_dense``, which leaves a parameter of the same shape and dtype on the meta device
so that the model still describes itself. Results equal ``F.linear`` up to float32
rounding order.

oneDNN builds (JIT-compiles) a primitive for every distinct input shape and keeps it in
two caches of 1024 entries each (its own primitive cache and ideep's, the latter per
thread), about 0.6 MB per primitive. A server sees every token count from 1 to
``max_num_batched_tokens``, and each one made new primitives for every linear: RSS grew by
hundreds of MB over the first 10,000 requests (``benches/soak.py``). So the rows are padded
(zeros) to one of a few sizes, ``padded_rows(m)``: exact up to 8, then at most 4 sizes
per power of two (at most 25% extra rows, 48 sizes up to 8192 tokens), and the
result is sliced back to ``m`` rows. Neither cache's capacity can be set through
PyTorch; fewer shapes bound both.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# Up to this many rows the shape is used as is; above, 2**(_SIZES_PER_OCTAVE_LOG2) sizes
# per power of two.
_EXACT_ROWS = 8
_SIZES_PER_OCTAVE_LOG2 = 2


def padded_rows(m: int) -> int:
    """The row count oneDNN sees for ``m`` rows: ``m`` up to 8, else ``m`` rounded up to
    a multiple of a quarter of the power of two below it (8, 10, 12, 14, 16, 20, 24, ...)."""
    if m <= _EXACT_ROWS:
        return m
    step = 1 << (m.bit_length() - 1 - _SIZES_PER_OCTAVE_LOG2)
    return -(-m // step) * step


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` [m, k] with zero rows appended up to ``rows``; ``x`` itself when it has them.

    The result of a packed linear is the leading rows of its padded output: fed to the
    next packed linear (the MLP's product, its down projection), that padded output is
    used as is. Its extra rows hold values computed from the zero rows; each output row
    depends on its own input row only, so they never reach the ``m`` rows kept.
    """
    m = x.shape[0]
    if rows == m:
        return x
    base = x._base
    if (base is not None and base.shape == (rows, x.shape[1]) and base.is_contiguous()
            and x.is_contiguous() and x.data_ptr() == base.data_ptr()):
        return base
    return F.pad(x, (0, 0, 0, rows - m))


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed for oneDNN (float32 on CPU, oneDNN present)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def release_dense(module: torch.nn.Module, name: str = "weight") -> None:
    """Free ``module.<name>`` once packed: a parameter of the same shape on the meta device."""
    dense = getattr(module, name)
    setattr(module, name, torch.nn.Parameter(torch.empty_like(dense, device="meta"), requires_grad=False))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T + b`` with a packed ``W``; ``x`` is [rows, in]."""
    m = x.shape[0]
    rows = padded_rows(m)
    out = _pointwise(_padded(x, rows), packed, bias, "none")
    return out if rows == m else out[:m]


def linear_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``silu(x W^T)``, the activation applied by the matmul."""
    m = x.shape[0]
    rows = padded_rows(m)
    out = _pointwise(_padded(x, rows), packed, None, "swish")
    return out if rows == m else out[:m]


def linear_gelu_tanh(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``gelu(x W^T)`` with the tanh approximation (Gemma's GeGLU), applied by the matmul."""
    m = x.shape[0]
    rows = padded_rows(m)
    out = _pointwise(_padded(x, rows), packed, None, "gelu", "tanh")
    return out if rows == m else out[:m]


def linear_times(x: torch.Tensor, packed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``(x W^T) * other``, the product taken by the matmul."""
    m = x.shape[0]
    rows = padded_rows(m)
    out = _binary(_padded(x, rows), _padded(other, rows), packed)
    return out if rows == m else out[:m]


# The only calls into oneDNN's linears (tests count the row counts they see).
def _pointwise(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], attr: str, algorithm: str = ""
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)


def _binary(x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, "mul")
