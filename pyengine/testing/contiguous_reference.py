"""A plain PyTorch forward over a contiguous KV cache: the lower bound for the paged path.

Every sequence owns a dense ``[kv_heads, max_len, head_dim]`` slab per layer, and the
batch is uniform (all sequences at the same position, same number of new tokens), so
attention is one SDPA call per layer with no gather and no mask. Benchmarks time it next
to the paged executor; tests check the paged executor gives the same results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyengine.models.decoder import DecoderForCausalLM


class ContiguousKVCache:
    """Dense per-sequence K/V: ``[layers, batch, kv_heads, max_len, head_dim]``."""

    def __init__(self, model: DecoderForCausalLM, batch: int, max_len: int) -> None:
        config = model.config
        dims = (config.num_hidden_layers, batch, model.num_kv_heads, max_len, config.head_dim)
        device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.keys = torch.zeros(dims, dtype=dtype, device=device)
        self.values = torch.zeros(dims, dtype=dtype, device=device)
        self.batch = batch
        self.length = 0


class _UniformStepAttention:
    def __init__(self, cache: ContiguousKVCache, new_tokens: int) -> None:
        self.cache = cache
        self.start = cache.length
        self.new_tokens = new_tokens

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, batch, n, start = self.cache, self.cache.batch, self.new_tokens, self.start
        _, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        end = start + n
        cache.keys[layer_index, :, :, start:end] = k.view(batch, n, kv_heads, head_dim).transpose(1, 2)
        cache.values[layer_index, :, :, start:end] = v.view(batch, n, kv_heads, head_dim).transpose(1, 2)
        keys = cache.keys[layer_index, :, :, :end]
        values = cache.values[layer_index, :, :, :end]
        if n == 1:  # decode: fold the GQA group into the query length
            grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)
            return F.scaled_dot_product_attention(grouped, keys, values).reshape(batch, heads, head_dim)
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
