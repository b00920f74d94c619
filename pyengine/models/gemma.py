"""Gemma 2 and Gemma 3 (text): the Llama-family decoder with Gemma's own layer details.

What differs from ``decoder.py`` (checked against transformers' ``modeling_gemma2/3``):

- every RMSNorm multiplies by ``1 + weight`` (computed in float32, then cast);
- each layer has four norms: the attention and MLP outputs are normed again before they
  join the residual stream (``post_attention_layernorm``, ``post_feedforward_layernorm``);
- the embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the weights' dtype);
- the MLP is GeGLU (``gelu_pytorch_tanh``), scores are scaled by
  ``query_pre_attn_scalar ** -0.5``, Gemma 2 soft-caps the attention scores and the final
  logits (``config.attn_logit_softcap`` / ``final_logit_softcap``, read by the layers and
  ``DecoderForCausalLM.local_logits``);
- local (sliding-window) and global layers alternate; Gemma 3 gives the local ones their
  own rotary base (``config.local_rope``) and norms q and k per head (with ``1 + weight``).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models.config import DecoderConfig
from pyengine.models.decoder import DecoderForCausalLM, DecoderLayer
from pyengine.models.layers import AttentionOp, DecoderAttention, RMSNorm, WeightTarget, _native_float32
from pyengine.models.parallel import ParallelContext


class GemmaRMSNorm(RMSNorm):
    """RMSNorm times ``1 + weight``, in float32 as transformers computes it.

    ``1 + weight`` is computed once the weights are final (``finish_loading``) and is what
    the native kernel multiplies by; before that (a model built by hand) on every call.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        with torch.no_grad():
            self.weight.zero_()  # the identity, as ones are for RMSNorm
        self.folded: Optional[torch.Tensor] = None

    def finish_loading(self) -> None:
        self.folded = 1.0 + self.weight.detach().float()

    def kernel_weight(self) -> torch.Tensor:
        return self.folded if self.folded is not None else 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _native_float32(x):
            return self._native(x, None)  # multiplies by kernel_weight()
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.kernel_weight()).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if _native_float32(x) and _native_float32(residual):
            return self._native(x, residual)
        residual.add_(x)
        return self(residual)


class GemmaAttention(DecoderAttention):
    norm_class = GemmaRMSNorm


class GemmaDecoderLayer(DecoderLayer):
    """Four norms: input, post-attention, pre-MLP and post-MLP (the "sandwich")."""

    attention_class = GemmaAttention

    def __init__(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> None:
        super().__init__(config, layer_index, parallel)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionOp,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``DecoderLayer.forward``: the returned output (the post-MLP norm's) joins the
        stream inside the next layer's input norm."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed = self.input_layernorm.add_and_norm(hidden, residual)
        attended = self.post_attention_layernorm(self.self_attn(normed, cos, sin, attention))
        normed = self.pre_feedforward_layernorm.add_and_norm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            **super().weight_targets(prefix),
            **self.pre_feedforward_layernorm.weight_targets(f"{prefix}.pre_feedforward_layernorm.weight"),
            **self.post_feedforward_layernorm.weight_targets(f"{prefix}.post_feedforward_layernorm.weight"),
        }


class _GemmaForCausalLM(DecoderForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm
    scales_embeddings = True


class Gemma2ForCausalLM(_GemmaForCausalLM):
    """Gemma 2: soft-capped attention and logits, alternating local / global layers."""


class Gemma3ForCausalLM(_GemmaForCausalLM):
    """Gemma 3 text (``gemma3_text``): q/k norms, local layers with their own rope base."""



