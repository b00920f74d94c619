"""A prefill chunk after a long cached context through the plain SDPA backend, one
layer's attention (``SdpaStepAttention.attend``): the context read and attended a slice of
``DEFAULT_SLICE_ROWS`` rows at a time (log-sum-exp merge, ``attention/sliced.py``, what
pyengine runs) against gathered whole into one SDPA call (``slice_rows`` past the context,
what ran before). Random K / V and queries, float32, CPU, Llama-3-8B's attention shape by
default (32 query heads, 8 KV heads, head_dim 128). Reports seconds per call (medians of
alternating calls), the peak bytes of the call's tensors (``testing.cpu_memory``) and the
largest difference between the two outputs.

One run, 2026-12-02 (defaults: 256 tokens after 16,384 cached, 1 thread, shared 2-core
machine at load 9-13): sliced 3,012 ms, 60.1 MiB at the peak; whole 2,767 ms, 158.5 MiB
(1.09x the time); outputs within 2e-7.

Usage: python benches/chunk_context.py [--json] [--tokens N] [--context N] [--heads N]
                                       [--kv-heads N] [--head-dim N] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.attention.sdpa import SdpaStepAttention
from pyengine.executor.attention.sliced import DEFAULT_SLICE_ROWS
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache
from pyengine.testing.cpu_memory import peak_tensor_bytes

BLOCK_SIZE = 16


def figures(tokens: int, context: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    total = context + tokens
    blocks = -(-total // BLOCK_SIZE)
    rng = torch.Generator().manual_seed(0)
    cache = PagedKVCache(KVCacheShape(1, kv_heads, head_dim, BLOCK_SIZE, torch.float32), blocks, torch.device("cpu"))
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=rng))
    cache.values.copy_(torch.randn(cache.values.shape, generator=rng))
    layout = StepAttentionLayout(
        query_start_loc=np.array([0, tokens]), seq_lens=np.array([total]), num_scheduled_tokens=np.array([tokens]),
        slot_mapping=torch.arange(context, total), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        block_size=BLOCK_SIZE,
    )
    q = torch.randn(tokens, heads, head_dim, generator=rng)
    k = torch.randn(tokens, kv_heads, head_dim, generator=rng)
    v = torch.randn(tokens, kv_heads, head_dim, generator=rng)
    slices = {"sliced": DEFAULT_SLICE_ROWS, "whole": total}

    def call(name: str) -> torch.Tensor:
        return SdpaStepAttention(cache, layout, slice_rows=slices[name]).attend(0, q, k, v)

    outputs = {name: call(name) for name in slices}  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in slices}
    for _ in range(repeats):
        for name in slices:
            start = time.perf_counter()
            call(name)
            seconds[name].append(time.perf_counter() - start)
    peak = {name: peak_tensor_bytes(lambda name=name: call(name)) for name in slices}
    ms = {name: statistics.median(times) * 1e3 for name, times in seconds.items()}
    return {
        "tokens": tokens, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        **{f"ms_{name}": round(value, 1) for name, value in ms.items()},
        **{f"peak_MiB_{name}": round(value / 2**20, 1) for name, value in peak.items()},
        "sliced_over_whole_time": round(ms["sliced"] / ms["whole"], 2),
        "max_abs_difference": float((outputs["sliced"] - outputs["whole"]).abs().max()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = figures(args.tokens, args.context, args.heads, args.kv_heads, args.head_dim, args.repeats)
    if args.json:
        print(json.dumps(result))
        return
    print(f"chunk of {args.tokens} tokens after {args.context} cached, {args.heads} / {args.kv_heads} heads x "
          f"{args.head_dim} ({args.threads} threads): sliced {result['ms_sliced']} ms, peak {result['peak_MiB_sliced']} "
          f"MiB; whole {result['ms_whole']} ms, peak {result['peak_MiB_whole']} MiB; max |sliced - whole| "
          f"{result['max_abs_difference']:.2e}")


if __name__ == "__main__":
    main()
