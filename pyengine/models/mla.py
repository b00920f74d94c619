"""Multi-head latent attention (DeepSeek-V2 / V3).

Each token's keys and values come from one ``kv_lora_rank`` latent ``c`` (normed output
of ``kv_a_proj_with_mqa``) plus a ``qk_rope_head_dim`` rotary key ``k_r`` that every head
shares; head h's key is ``[W_UK_h c, k_r]`` and its value ``W_UV_h c`` (``kv_b_proj``
holds ``W_UK_h`` and ``W_UV_h`` row after row). The cache stores ``[c, k_r]`` only.

The layer hands the attention op its queries per head (:class:`LatentQueries`, with the
head's up-projections), and the op picks one of two equal forms per sequence
(``LatentAttentionOp.attend_mla``):

- absorbed (``q_h . W_UK_h c = (W_UK_h^T q_h) . c``): queries into latent space,
  attention over the cached rows as they are, ``W_UV_h`` mapping each head's weighted
  latent to its value space after; nothing is expanded per context row. What decodes
  and short chunks take: one query row against a long context.
- expanded: the context rows decompressed into each head's keys ``[W_UK_h c, k_r]`` and
  values ``W_UV_h c``, then ordinary attention; what a long prefill chunk takes, where
  the context is about as long as the chunk and the absorbed form's wider dot products
  (``kv_lora_rank + qk_rope_head_dim`` against ``qk_head_dim``) cost more than the
  expansion (``mla_sdpa.expands``). The op expands a bounded slice of the context at a
  time (``executor/attention/mla_chunk.py``), whatever its length; the absorbed form
  attends a bounded slice of the cached rows at a time too.

Rotary: DeepSeek's weights rotate interleaved pairs ``(x0, x1), (x2, x3), ...``
(transformers' V2 always, V3 under ``rope_interleave``); the rotated halves are written
evens first, odds after, for queries and keys alike, which leaves every dot product as
the checkpoint means it.

Tensor parallelism: the heads split (``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` by
column, ``o_proj`` by row, one all-reduce); the low-rank projections ``q_a_proj`` and
``kv_a_proj_with_mqa`` are replicated, so every rank computes and caches the same latent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from pyengine.models.config import DecoderConfig
from pyengine.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, WeightTarget
from pyengine.models.parallel import ParallelContext, Shard
from pyengine.models.rope import apply_rotary


@dataclass(frozen=True)
class LatentQueries:
    """One step's queries of this rank's heads, with what turns them into either form:
    ``nope`` [T, heads, qk_nope], ``rope`` [T, heads, qk_rope] (rotated), ``w_uk``
    [heads, qk_nope, rank] and ``w_uv`` [heads, v, rank] (views of ``kv_b_proj``)."""

    nope: torch.Tensor
    rope: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def absorbed(self, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[t, heads, rank + qk_rope]: the queries of ``tokens`` (None: all) in latent space."""
        nope, rope = (self.nope, self.rope) if tokens is None else (self.nope[tokens], self.rope[tokens])
        # [heads, t, nope] x [heads, nope, rank] -> [t, heads, rank]
        return torch.cat([torch.bmm(nope.transpose(0, 1), self.w_uk).transpose(0, 1), rope], dim=-1)

    def values(self, weighted: torch.Tensor) -> torch.Tensor:
        """[t, heads, v] from the attention-weighted latents [t, heads, rank]."""
        return torch.bmm(weighted.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)

    def expanded(self, start: int, end: int) -> torch.Tensor:
        """[heads, end - start, qk_head_dim]: tokens ``start:end``'s queries per head."""
        return torch.cat([self.nope[start:end], self.rope[start:end]], dim=-1).transpose(0, 1)

    def keys_values(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context rows [L, rank + qk_rope] expanded: keys [heads, L, qk_head_dim] (the
        rotary key shared by every head) and values [heads, L, v]."""
        heads, nope_dim, rank = self.w_uk.shape
        latent, k_rope = rows[:, :rank], rows[:, rank:]
        k_nope = torch.matmul(latent, self.w_uk.transpose(1, 2))  # [heads, L, nope]
        v = torch.matmul(latent, self.w_uv.transpose(1, 2))  # [heads, L, v]
        return torch.cat([k_nope, k_rope.unsqueeze(0).expand(heads, -1, -1)], dim=-1), v


class LatentAttentionOp(Protocol):
    """What a latent attention layer calls: write this step's latent rows, attend over them."""

    def attend_mla(self, layer_index: int, queries: LatentQueries, latent: torch.Tensor, scale: float) -> torch.Tensor:
        """``latent`` [T, rank + qk_rope] (this step's rows, written to the cache) ->
        [T, heads, v]: each head's attention output in its value space."""
        ...


def _replicated(size: int) -> Shard:
    return Shard(size, 0, size)


class HeadUpProjections(torch.nn.Module):
    """``kv_b_proj``: this rank's heads' ``W_UK`` / ``W_UV`` rows, read per head by the
    absorbed attention and never run as a linear (so neither packed nor quantized)."""

    def __init__(self, rank: int, part: Shard) -> None:
        super().__init__()
        self.part = part
        self.weight = torch.nn.Parameter(torch.empty(part.size, rank))

    def weight_targets(self, name: str) -> dict[str, WeightTarget]:
        shape = (self.part.full, self.weight.shape[1])
        return {f"{name}.weight": WeightTarget(self.weight, shape, shard_dim=0, shard=self.part)}


class LatentAttention(torch.nn.Module):
    """MLA with the up-projections absorbed (see the module docstring)."""

    def __init__(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError("LatentAttention needs a config with MLA fields (DeepSeek-V2 / V3)")
        self.layer_index = layer_index
        self.mla = mla
        heads = parallel.split(config.num_attention_heads, "num_attention_heads")
        self.num_heads = heads.size
        hidden = config.hidden_size
        qk, per_head_kv = mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
        q_part = Shard(heads.full * qk, heads.start * qk, heads.size * qk)
        self.q_proj: Optional[ColumnParallelLinear] = None
        self.q_a_proj: Optional[ColumnParallelLinear] = None
        self.q_a_layernorm: Optional[RMSNorm] = None
        self.q_b_proj: Optional[ColumnParallelLinear] = None
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [q_part], False, parallel)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, [_replicated(mla.q_lora_rank)], False, parallel)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [q_part], False, parallel)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, [_replicated(mla.latent_dim)], False, parallel)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps)
        kv_part = Shard(heads.full * per_head_kv, heads.start * per_head_kv, heads.size * per_head_kv)
        self.kv_b_proj = HeadUpProjections(mla.kv_lora_rank, kv_part)
        self.o_proj = RowParallelLinear(
            heads.full * mla.v_head_dim, hidden, parallel, "num_attention_heads x v_head_dim"
        )

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: LatentAttentionOp
    ) -> torch.Tensor:
        mla, tokens = self.mla, hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)
        latent, k_rope = compressed.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_rope = self._rotate(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        w_uk, w_uv = self._up_projections()
        queries = LatentQueries(q_nope, self._rotate(q_rope, cos, sin), w_uk, w_uv)
        rows = torch.cat([latent, k_rope], dim=-1)
        values = attention.attend_mla(self.layer_index, queries, rows, mla.softmax_scale)
        return self.o_proj(values.reshape(tokens, self.num_heads * mla.v_head_dim))

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` [heads, nope, rank] and ``W_UV`` [heads, v, rank]: views of kv_b_proj."""
        mla = self.mla
        per_head = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return per_head[:, : mla.qk_nope_head_dim], per_head[:, mla.qk_nope_head_dim :]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on [T, heads, rope_dim] (cos / sin [T, 1, rope_dim], rotate-half tables)."""
        if not self.mla.rope_interleave:
            return apply_rotary(x, cos, sin)
        half = x.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    def pack_for_cpu(self) -> None:
        """Pack the linears for oneDNN (``cpu_linear``); kv_b_proj stays dense (read per head)."""
        for linear in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.o_proj):
            if linear is not None:
                linear.pack_for_cpu()

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets: dict[str, WeightTarget] = {}
        if self.q_proj is not None:
            targets.update(self.q_proj.weight_targets([f"{prefix}.q_proj"]))
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            targets.update(self.q_a_proj.weight_targets([f"{prefix}.q_a_proj"]))
            targets.update(self.q_a_layernorm.weight_targets(f"{prefix}.q_a_layernorm.weight"))
            targets.update(self.q_b_proj.weight_targets([f"{prefix}.q_b_proj"]))
        targets.update(self.kv_a_proj_with_mqa.weight_targets([f"{prefix}.kv_a_proj_with_mqa"]))
        targets.update(self.kv_a_layernorm.weight_targets(f"{prefix}.kv_a_layernorm.weight"))
        targets.update(self.kv_b_proj.weight_targets(f"{prefix}.kv_b_proj"))
        targets.update(self.o_proj.weight_targets(f"{prefix}.o_proj"))
        return targets
