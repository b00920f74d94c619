"""The routed experts of a mixture-of-experts layer, run grouped by expert.

Every expert is a gated MLP ``down(silu(gate(x)) * up(x))``. A step routes each token to
``k`` experts (:class:`~pyengine.models.router.Routing`); the ``T * k`` (token, expert)
pairs are sorted by expert once, so that each expert's tokens are one contiguous block
of rows, and the products run per group, never per token:

- on CUDA (bfloat16, sm90+) as two grouped matmuls (``torch._grouped_mm``: CUTLASS's
  grouped GEMM, ragged groups by offsets, no padding);
- elsewhere (CPU) one product per expert that received rows (``expert_matmuls.py``):
  the native skinny kernels on decode-sized blocks, reading each expert's weight once
  as loaded, ``F.linear`` on wider ones; quantized experts through their
  ``PackedWeight``s (``set_packed_weights``, ``quantization="int8"`` / ``"int4"``).
  ``expert_matmuls.py`` says why not ``_grouped_mm`` on CPU, with the figures.

The results are put back in (token, slot) order and each token's ``k`` rows summed with
their routing weights by one batched product (deterministic: no atomic scatter-add).

Tensor parallelism: each rank holds a slice of every expert's intermediate features
(gate/up rows, down columns, like the dense MLP), so the output here is this rank's
partial sum; the caller all-reduces it once with the rest of the block.

Expert parallelism (``ParallelContext.expert_parallel``): each rank holds
``num_experts / N`` whole experts instead. Every rank routes every token alike (the
router is replicated), keeps the (token, expert) pairs whose expert it holds and runs
only those; the other pairs are zero rows here, so the output is again this rank's
partial sum, and the block's one all-reduce combines the ranks' experts. That
all-reduce of ``[tokens, hidden]`` is the simple correct form at this scale: every rank
sees every token, no all-to-all dispatch moves tokens to their experts' ranks (which
pays off only when the tokens per step and the ranks are many).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pyengine.models import cpu_linear
from pyengine.models.expert_matmuls import FloatExpertMatmuls, QuantizedExpertMatmuls, run_experts
from pyengine.models.layers import WeightTarget
from pyengine.models.parallel import ParallelContext, Shard
from pyengine.models.quantization.packed import PackedWeight, QuantizationError
from pyengine.models.router import Routing


class GroupedExperts(torch.nn.Module):
    """``num_experts`` gated MLPs of ``intermediate_size`` features (this rank's slice),
    or under expert parallelism this rank's share of the experts, whole.

    Parameters keep the checkpoint's layout, stacked: ``gate_up`` is ``[E * 2I, H]``
    (expert e's gate rows, then its up rows) and ``down`` ``[E * H, I]``, so each
    per-expert checkpoint tensor fills a block of rows, and each expert's weight is a
    contiguous ``[out, in]`` block, the layout the native kernels read. ``E`` is
    ``num_experts`` here, the experts this rank holds (``held``: which of them).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        #: The routed experts this rank holds (all of them unless expert-parallel).
        self.held = parallel.experts(num_experts)
        self.num_experts = self.held.size
        self.hidden_size = hidden_size
        if parallel.expert_parallel:
            self.part = Shard(intermediate_size, 0, intermediate_size)
        else:
            self.part = parallel.split(intermediate_size, "moe_intermediate_size")
        local = self.part.size
        self.gate_up = torch.nn.Parameter(torch.empty(self.num_experts * 2 * local, hidden_size))
        self.down = torch.nn.Parameter(torch.empty(self.num_experts * hidden_size, local))
        #: The packed experts once quantized (``set_packed_weights``); the float ones are released.
        self.quantized: Optional[QuantizedExpertMatmuls] = None

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """This rank's partial output [T, H] for ``x`` [T, H] routed by ``routing``."""
        tokens, top_k = routing.expert_ids.shape
        pairs, expert_ids = self._held_pairs(routing.expert_ids.reshape(-1))
        if expert_ids.numel() == 0:  # no token, or none routed to this rank's experts
            return torch.zeros_like(x)
        order = torch.argsort(expert_ids, stable=True)
        slots = order if pairs is None else pairs.index_select(0, order)  # each sorted row's (token, slot)
        rows = x.index_select(0, slots // top_k)  # [P, H], grouped by expert
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        local = self.part.size
        gate_up = self.gate_up.view(self.num_experts, 2 * local, self.hidden_size)
        down = self.down.view(self.num_experts, self.hidden_size, local)
        if self.quantized is not None:
            out = run_experts(rows, counts, self.quantized, local, self.hidden_size)
        elif _grouped_mm_fits(x, self.hidden_size, local):
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            hidden = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)
            gate, up = hidden.chunk(2, dim=-1)
            out = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)
        else:
            out = run_experts(rows, counts, FloatExpertMatmuls(gate_up, down), local, self.hidden_size)
        if pairs is None:
            unsorted = torch.empty_like(out).index_copy_(0, order, out)
        else:  # the pairs of other ranks' experts stay zero rows
            unsorted = out.new_zeros(tokens * top_k, self.hidden_size).index_copy_(0, slots, out)
        weights = routing.weights.to(x.dtype).unsqueeze(1)  # [T, 1, k]
        return torch.bmm(weights, unsorted.view(tokens, top_k, self.hidden_size)).squeeze(1)

    def _held_pairs(self, flat: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(positions in ``flat`` of the pairs whose expert this rank holds, or None for
        all of them; those pairs' expert ids counted from this rank's first expert)."""
        held = self.held
        if held.size == held.full:
            return None, flat
        mine = (flat >= held.start) & (flat < held.start + held.size)
        pairs = mine.nonzero().squeeze(1)
        return pairs, flat.index_select(0, pairs) - held.start

    def set_packed_weights(self, gate_up: PackedWeight, down: PackedWeight) -> None:
        """Multiply by packed experts from now on: ``gate_up`` [E * 2I, H] and ``down``
        [E * H, I] (this rank's slices, stacked like the parameters); the float
        parameters are released (meta tensors of the same shape)."""
        for name, weight in (("gate_up", gate_up), ("down", down)):
            dense = getattr(self, name)
            if (weight.out_features, weight.in_features) != tuple(dense.shape):
                raise QuantizationError(
                    f"packed experts' {name} is [{weight.out_features}, {weight.in_features}], the layer's is "
                    f"{list(dense.shape)}"
                )
        self.quantized = QuantizedExpertMatmuls(gate_up, down, self.num_experts)
        cpu_linear.release_dense(self, "gate_up")
        cpu_linear.release_dense(self, "down")

    def weight_targets(self, prefix: str, names: tuple[str, str, str]) -> dict[str, WeightTarget]:
        """Per-expert checkpoint tensors ``{prefix}.{e}.{gate|up|down}.weight``, ``names``
        the three projections' names (("gate_proj", "up_proj", "down_proj") or Mixtral's
        ("w1", "w3", "w2"))."""
        gate_name, up_name, down_name = names
        part, local, hidden = self.part, self.part.size, self.hidden_size
        targets = {}
        for expert in range(self.held.full):
            base = f"{prefix}.{expert}"
            index = expert - self.held.start
            if not 0 <= index < self.held.size:  # another rank's expert: named, not read
                none = Shard(part.full, 0, 0)
                targets[f"{base}.{gate_name}.weight"] = WeightTarget(self.gate_up, (part.full, hidden), 0, 0, none)
                targets[f"{base}.{up_name}.weight"] = WeightTarget(self.gate_up, (part.full, hidden), 0, 0, none)
                targets[f"{base}.{down_name}.weight"] = WeightTarget(self.down, (hidden, part.full), 1, 0, none)
                continue
            rows = index * 2 * local
            targets[f"{base}.{gate_name}.weight"] = WeightTarget(
                self.gate_up, (part.full, hidden), shard_dim=0, row_offset=rows, shard=part
            )
            targets[f"{base}.{up_name}.weight"] = WeightTarget(
                self.gate_up, (part.full, hidden), shard_dim=0, row_offset=rows + local, shard=part
            )
            targets[f"{base}.{down_name}.weight"] = WeightTarget(
                self.down, (hidden, part.full), shard_dim=1, row_offset=index * hidden, shard=part
            )
        return targets


def _grouped_mm_fits(x: torch.Tensor, hidden: int, local: int) -> bool:
    """Whether the products run as ``torch._grouped_mm``: bfloat16 on CUDA sm90+ with
    feature sizes that keep its 16-byte alignment (on CPU the per-expert products are
    faster: see ``expert_matmuls.py``)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return (
            x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and hidden % 8 == 0
            and local % 8 == 0
        )
    return False

