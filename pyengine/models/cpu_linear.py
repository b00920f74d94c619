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
"""

from __future__ import annotations

from typing import Optional

import torch


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
    """``x W^T + b`` with a packed ``W``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``silu(x W^T)``, the activation applied by the matmul."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "swish", [], "")


def linear_times(x: torch.Tensor, packed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``(x W^T) * other``, the product taken by the matmul."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, "mul")
