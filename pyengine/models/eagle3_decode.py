"""The EAGLE-3 head's proposal steps through the native decode kernels.

A proposal step is one token per proposing sequence through the head's one layer, k times
a step. At batch 1 the module path's plumbing (some 25 module calls, views, splits and
eligibility checks) costs more than the kernels: 0.65 ms a head step on the tiny bench
model, where a target layer on the native decode path (``decode_path``) takes 0.28. With
every proposal wrong, that plumbing is most of what speculation costs.

This program runs ``Eagle3Head.forward``'s kernels in the same order on the same tensors
(``gemv`` products, ``rms_norm``, ``qk_norm_rope``, the attention backend's
``FusedDecodeAttention``), so its results are the module path's, bit for bit
(``tests/test_eagle3_decode.py`` compares them). What can be looked up once (the products'
arrays, the norms' weights) is looked up when it is built, after the head's weights are
final (``load_eagle3_head``).

It runs when the step's attention offers ``fused_decode`` (every row a decode row, float32
on CPU), there are at most ``gemv.MAX_ROWS`` rows and the inputs are float32 on the CPU;
the head qualifies when its norms are plain ``RMSNorm`` and every linear takes the native
kernels. Anything else runs the modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from pyengine import _kernels
from pyengine.models import gemv
from pyengine.models.decode_path import NativeLinear, NativeNorm, activate_and_down, dense_mlp_fits, rope_rows
from pyengine.models.layers import AttentionOp, GatedMLP

if TYPE_CHECKING:
    from pyengine.models.eagle3 import Eagle3Head


class HeadDecodeProgram:
    """One head step as ``Eagle3Head.forward`` computes it, for decode rows (module docstring)."""

    def __init__(self, head: "Eagle3Head") -> None:
        attention = head.self_attn
        self.rotary = head.rotary
        self.norm_before_residual = head.config.norm_before_residual
        self.input_norm = NativeNorm(head.input_layernorm)
        self.hidden_norm = NativeNorm(head.hidden_norm)
        self.post_norm = NativeNorm(head.post_attention_layernorm)
        self.final_norm = NativeNorm(head.norm)
        self.qkv = NativeLinear(attention.qkv_proj)
        self.o = NativeLinear(attention.o_proj)
        self.gate_up = NativeLinear(head.mlp.gate_up_proj)
        self.down = NativeLinear(head.mlp.down_proj)
        self.gelu = bool(head.mlp.gelu)
        q_norm, k_norm = attention.q_norm, attention.k_norm
        self.q_norm = None if q_norm is None else q_norm.kernel_weight().detach().numpy()
        self.k_norm = None if k_norm is None else k_norm.kernel_weight().detach().numpy()
        self.qk_eps = q_norm.eps if q_norm is not None else 0.0
        self.layer_index = attention.layer_index
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.spec = attention.spec

    @classmethod
    def build(cls, head: "Eagle3Head") -> Optional["HeadDecodeProgram"]:
        """The program for ``head`` (its weights final, rope tables built), or None where its
        norms or weights do not qualify."""
        attention = head.self_attn
        norms = (head.input_layernorm, head.hidden_norm, head.post_attention_layernorm, head.norm,
                 attention.q_norm, attention.k_norm)
        if head.rotary is None or not all(NativeNorm.fits(norm) for norm in norms):
            return None
        if (attention.q_norm is None) != (attention.k_norm is None) or type(head.mlp) is not GatedMLP:
            return None
        if not (NativeLinear.fits(attention.qkv_proj) and NativeLinear.fits(attention.o_proj)
                and dense_mlp_fits(head.mlp)):
            return None
        return cls(head)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention: AttentionOp) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``Eagle3Head.forward``'s (final-normed output, pre-norm output), or None (nothing
        done) when this step is not one the program takes."""
        rows = embeds.shape[0]
        fused_decode = getattr(attention, "fused_decode", None)
        if not 0 < rows <= gemv.MAX_ROWS or fused_decode is None or not (_float32_cpu(embeds) and _float32_cpu(hidden)):
            return None
        fused = fused_decode()
        if fused is None:
            return None
        threads = torch.get_num_threads()
        e = self.input_norm(embeds, None, threads)
        if self.norm_before_residual:
            h = self.hidden_norm(hidden, None, threads)
            residual = h.clone()
        else:
            residual = hidden.clone()
            h = self.hidden_norm(hidden, None, threads)
        x = torch.cat([e, h], dim=-1)
        assert self.rotary is not None  # build() checked
        cos, sin = rope_rows(self.rotary.cos_sin(positions, x.dtype), rows)
        qkv = self.qkv(x, threads)
        _kernels.qk_norm_rope(qkv.numpy(), cos, sin, self.num_heads, self.num_kv_heads, self.q_norm, self.k_norm,
                              self.qk_eps, threads)
        attended = fused.attend_fused(self.layer_index, qkv, self.num_heads, self.spec)
        normed = self.post_norm(self.o(attended, threads), residual, threads)
        mlp = activate_and_down(self.gate_up(normed, threads), self.down, self.gelu, threads)
        return self.final_norm(mlp, residual, threads), residual


def _float32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
