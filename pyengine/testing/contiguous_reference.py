"""A plain PyTorch forward over a contiguous KV cache: the lower bound for the paged path.

Every sequence owns a dense ``[kv_heads, max_len, head_dim]`` slab per layer, and the
batch is uniform (all sequences at the same position, same number of new tokens), so
attention is one SDPA call per layer with no gather and no mask. Benchmarks time it next
to the paged executor; tests check the paged executor gives the same results.
:class:`NativeDecodeKVCache` runs decode attention through the engine's own CPU kernel
instead, for a bound that uses the same kernels as the engine.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import _kernels
from pyengine.executor.attention.windowed import attend_masked, window_mask
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.layers import FULL_ATTENTION, LayerAttention


class ContiguousKVCache:
    """Dense per-sequence K/V: ``[layers, batch, kv_heads, max_len, head_dim]`` (SDPA's layout)."""

    def __init__(self, model: DecoderForCausalLM, batch: int, max_len: int) -> None:
        config = model.config
        device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        dims = self._dims(config.num_hidden_layers, batch, model.num_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(dims, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.batch = batch
        self.length = 0

    @staticmethod
    def _dims(layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int) -> tuple[int, ...]:
        return (layers, batch, kv_heads, max_len, head_dim)

    def write(self, layer_index: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[batch, n, kv_heads, head_dim]`` at positions ``start..start+n``."""
        end = start + k.shape[1]
        self.keys[layer_index, :, :, start:end] = k.transpose(1, 2)
        self.values[layer_index, :, :, start:end] = v.transpose(1, 2)

    def context(self, layer_index: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0..end``, ``[batch, kv_heads, end, head_dim]``."""
        return self.keys[layer_index, :, :, :end], self.values[layer_index, :, :, :end]

    def decode_attention(self, layer_index: int, q: torch.Tensor, end: int) -> torch.Tensor:
        """One query per sequence ``[batch, heads, head_dim]`` over positions ``0..end``."""
        keys, values = self.context(layer_index, end)
        batch, heads, head_dim = q.shape
        kv_heads = keys.shape[1]
        grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)  # fold the GQA group into the query length
        return F.scaled_dot_product_attention(grouped, keys, values).reshape(batch, heads, head_dim)


class NativeDecodeKVCache(ContiguousKVCache):
    """The same cache laid out ``[layers, batch, max_len, kv_heads, head_dim]``: each sequence
    is one contiguous block, and decode attention runs the engine's native CPU kernel
    (``_kernels.paged_decode_attention``, float32) on it. Prefill still goes through SDPA."""

    @staticmethod
    def _dims(layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int) -> tuple[int, ...]:
        return (layers, batch, max_len, kv_heads, head_dim)

    def write(self, layer_index: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[1]
        self.keys[layer_index, :, start:end] = k
        self.values[layer_index, :, start:end] = v

    def context(self, layer_index: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_index, :, :end].transpose(1, 2), self.values[layer_index, :, :end].transpose(1, 2)

    def decode_attention(self, layer_index: int, q: torch.Tensor, end: int) -> torch.Tensor:
        out = torch.empty_like(q)
        _kernels.paged_decode_attention(
            out.numpy(),
            q.contiguous().numpy(),
            self.keys[layer_index].numpy(),
            self.values[layer_index].numpy(),
            np.arange(self.batch, dtype=np.int32)[:, None],
            np.full(self.batch, end, dtype=np.int32),
            q.shape[-1] ** -0.5,
            torch.get_num_threads(),
        )
        return out


class _UniformStepAttention:
    def __init__(self, cache: ContiguousKVCache, new_tokens: int) -> None:
        self.cache = cache
        self.start = cache.length
        self.new_tokens = new_tokens

    def attend(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:
        cache, batch, n, start = self.cache, self.cache.batch, self.new_tokens, self.start
        _, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        end = start + n
        cache.write(layer_index, start, k.view(batch, n, kv_heads, head_dim), v.view(batch, n, kv_heads, head_dim))
        if spec != FULL_ATTENTION:  # window / scale / soft-cap: a plain mask over the whole context
            keys, values = cache.context(layer_index, end)
            query = q.view(batch, n, heads, head_dim).transpose(1, 2)
            mask = window_mask(start, n, 0, end, q.device, spec.window)
            out = torch.stack([attend_masked(query[b], keys[b], values[b], mask, spec) for b in range(batch)])
            return out.transpose(1, 2).reshape(batch * n, heads, head_dim)
        if n == 1:
            return cache.decode_attention(layer_index, q, end)
        keys, values = cache.context(layer_index, end)
        query = q.view(batch, n, heads, head_dim).transpose(1, 2)
        if start == 0:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
        else:
            positions = torch.arange(start, end, device=q.device)
            mask = torch.arange(end, device=q.device)[None, :] <= positions[:, None]
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(batch * n, heads, head_dim)


@torch.inference_mode()
def contiguous_step(
    model: DecoderForCausalLM, cache: ContiguousKVCache, token_ids: torch.Tensor
) -> torch.Tensor:
    """Run ``token_ids`` [batch, n] (the next n tokens of every sequence); logits of the last.

    Returns float32 logits ``[batch, vocab]`` and advances the cache by n.
    """
    batch, n = token_ids.shape
    positions = torch.arange(cache.length, cache.length + n, device=token_ids.device).repeat(batch)
    hidden = model(token_ids.reshape(-1), positions, _UniformStepAttention(cache, n))
    cache.length += n
    return model.compute_logits(hidden.view(batch, n, -1)[:, -1])
