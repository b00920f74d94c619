"""Multi-head latent attention (DeepSeek): KV bytes per token and decode step time.

Model: DeepSeek-V2-Lite's attention (16 heads, qk_nope 128 + qk_rope 64, v 128,
kv_lora_rank 512, no q_lora_rank) on a small body (hidden 1024, 2 dense layers,
intermediate 1024, vocabulary 4096), random weights, float32, CPU. Measured in one run:

- KV bytes per token and layer: the latent cache as the runner sized it
  (``kv_shape.bytes_per_block``) against the same model's expanded K and V
  (``heads * (qk_head_dim + v_head_dim)`` values), and the blocks a 1 GiB budget buys
  each way; plus the ratios the published V2-Lite and V3 dimensions imply.
- decode step time (``ModelRunner.execute``, ``--batch`` rows of ``--context`` tokens):
  "absorbed" is what pyengine runs (``W_UK`` folded into the query, attention over the
  latent rows in place, ``W_UV`` after); "expanded" is the same model and the same latent
  cache, but each step expands every context row into per-head K and V (``kv_b_proj``)
  and attends over those, the straightforward alternative. Steps alternate between the
  two so both see the same machine.
- prefill tokens/s (``--prefill`` tokens, one prompt in one step, ``--prefill-repeats``
  alternating runs, medians): "prefill_expanded" is what pyengine runs (a prompt chunk
  whose expansion costs less, ``mla_sdpa.expands``, is decompressed into per-head K and
  V and attended with ``qk_head_dim``-wide dot products), "prefill_absorbed" the absorbed
  form for every chunk (``MlaSdpaBackend(expand_prefill=False)``, what ran before); the
  two prefills' greedy tokens are compared.
- a chunk after cached context (``--prefill`` tokens after ``--chunk-context``, the
  context prefilled untimed before each run): expanded in slices of 1024 rows (what
  pyengine runs, ``mla_chunk`` / ``sliced``), expanded whole (every context row at once,
  what ran before the slices) and absorbed.
- a short (absorbed) chunk after a long context, one layer's attention op alone
  (``--absorbed-tokens`` after ``--absorbed-context`` random latent rows, the bench
  model's head sizes with ``--absorbed-heads`` heads): the context in slices of 1024
  rows (what pyengine runs) against whole in one SDPA call (what ran before): ms per call
  and the peak bytes of the call's tensors (``testing.cpu_memory``, the profiler's
  memory timeline).

Usage: python benches/mla.py [--json] [--steps N] [--batch N] [--context N] [--threads N]
                             [--prefill N] [--prefill-repeats N] [--chunk-context N]
                             [--absorbed-context N] [--absorbed-tokens N] [--absorbed-heads N]

One run (1 thread, batch 8, context 512, 6 steps; 2 cores shared with other jobs, load
average 15, so the times are loose): latent 2304 B against expanded 20480 B per token and
layer (8.89x; 14563 against 1638 blocks of 16 tokens per GiB); decode 253 ms absorbed
against 6389 ms expanded per step (25x), the same 64 of 64 greedy tokens.

Prefill, 2026-12-02 (1 thread, same shared machine): ``--prefill 1024`` at load 18:
652 tokens/s expanded against 267 absorbed (2.44x); ``--prefill 2048`` at load 9-14:
393 against 195 (2.01x); the same first token each time. (``--steps 2 --batch 2
--context 128 --prefill-repeats 3``.)

Chunk after context, 2026-12-02 (same flags, ``--prefill 1024``, default ``--chunk-context
2048``, load 10-12): 270 tokens/s in slices against 197 expanded whole (1.37x) and 94
absorbed (2.88x), the same first token; the fresh 1024-token prefill in the same run 635
against 346 (1.83x).

Absorbed chunk after a long context, 2026-12-02 (``--steps 1 --batch 1 --context 32
--prefill 0``: 64 tokens after 16,384 rows, 16 heads, 1 thread, load 9-13): 751 ms and
18.8 MiB of tensors at the peak in slices against 3,263 ms and 1,782 MiB in one call (the
whole form, what ran before), outputs within 3e-7.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.attention.mla_sdpa import MlaSdpaBackend, MlaStepAttention, expands
from pyengine.executor.attention.sliced import DEFAULT_SLICE_ROWS
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.kv_cache import KVCacheShape, blocks_for_budget
from pyengine.executor.latent_kv_cache import LatentKVCache, LatentKVCacheShape
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.mla import LatentQueries
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.cpu_memory import peak_tensor_bytes
from pyengine.testing.hand_plan import HandPlanner

MODEL = dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
             num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
             qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=2)
VOCAB = 4096
BLOCK_SIZE = 16
BUDGET = 1 << 30
# (heads, qk_nope, qk_rope, v, kv_lora_rank) of the published checkpoints.
PUBLISHED = {"DeepSeek-V2-Lite": (16, 128, 64, 128, 512), "DeepSeek-V3": (128, 128, 64, 128, 512)}


def expanded_forward(self, hidden, cos, sin, attention):
    """``LatentAttention.forward`` without the absorption: queries stay per head, and the
    attention op expands the cached latents into K and V (bench only)."""
    mla, tokens = self.mla, hidden.shape[0]
    q = self.q_proj(hidden).view(tokens, self.num_heads, mla.qk_head_dim)
    q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
    latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    rows = torch.cat([self.kv_a_layernorm(latent.contiguous()), self._rotate(k_rope.unsqueeze(1), cos, sin).squeeze(1)], -1)
    query = torch.cat([q_nope, self._rotate(q_rope, cos, sin)], dim=-1)
    out = attention.attend_expanded(self.layer_index, query, rows, self.kv_b_proj.weight, mla)
    return self.o_proj(out.reshape(tokens, self.num_heads * mla.v_head_dim))


class ExpandingDecode:
    """Decode-only step over the latent cache that expands every context row per step."""

    def __init__(self, cache, layout) -> None:
        self.cache, self.layout = cache, layout

    def attend_expanded(self, layer_index, q, rows, kv_b_weight, mla):
        layout = self.layout
        self.cache.layer_slots(layer_index).index_copy_(0, layout.slot_mapping, rows)
        num_rows, heads = q.shape[0], q.shape[1]
        length = int(layout.seq_lens.max())
        width = -(-length // layout.block_size)
        ids = layout.block_tables[:, :width].reshape(-1).to(torch.int64)
        context = self.cache.layer_blocks(layer_index).index_select(0, ids).view(num_rows, -1, mla.latent_dim)[:, :length]
        kv = F.linear(context[..., : mla.kv_lora_rank], kv_b_weight).view(num_rows, length, heads, -1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_rope = context[..., mla.kv_lora_rank :].unsqueeze(2).expand(-1, -1, heads, -1)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(1, 2)
        lengths = torch.from_numpy(layout.seq_lens.astype(np.int64))
        mask = (torch.arange(length)[None, :] < lengths[:, None]).view(num_rows, 1, 1, length)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v.transpose(1, 2), attn_mask=mask, scale=mla.softmax_scale
        )
        return out.squeeze(2)


class ExpandingBackend:
    name = "mla_expanded_bench"

    def bind(self, cache, layout):
        return ExpandingDecode(cache, layout)


class Decoder:
    """``batch`` requests prefilled to ``context - 1`` tokens; ``step()`` times one decode."""

    def __init__(self, folder: Path, batch: int, context: int, expanded: bool) -> None:
        blocks = batch * (-(-(context + 64) // BLOCK_SIZE))
        self.runner = ModelRunner.from_pretrained(
            folder, ExecutorConfig(dtype="float32", max_num_seqs=batch, max_model_len=context + 64,
                                   block_size=BLOCK_SIZE, num_kv_blocks=blocks)
        )
        self.planner = HandPlanner(block_size=BLOCK_SIZE, num_blocks=blocks, max_rows=batch, seed=1)
        rng = np.random.default_rng(0)
        for _ in range(batch):
            self.planner.add(rng.integers(0, VOCAB, size=context - 1).tolist(), SamplingParams(temperature=0.0))
        for _ in range(batch):  # one prompt per step, through the absorbed path (the cache is the same)
            self.step()
        if expanded:
            self.runner.attention_backend = ExpandingBackend()
            for layer in self.runner.model.layers:
                layer.self_attn.forward = types.MethodType(expanded_forward, layer.self_attn)

    def step(self) -> float:
        plan = self.planner.next_plan()
        start = time.perf_counter()
        out = self.runner.execute(plan)
        elapsed = time.perf_counter() - start
        self.planner.record(plan, out.sampled_token_ids)
        self.last_tokens = out.sampled_token_ids.tolist()
        return elapsed


def timed_chunks(folder: Path, length: int, context: int, backends: dict[str, MlaSdpaBackend], repeats: int,
                 seed: int) -> tuple[dict[str, float], dict[str, int]]:
    """Tokens/s (medians) of a ``length``-token chunk after ``context`` cached tokens (0: a
    fresh prompt) in one step under each backend, and each one's first token: backends
    alternate on one runner, the context prefilled untimed before each run, the sequence
    finished after it."""
    total = context + length
    blocks = -(-(total + 16) // BLOCK_SIZE)
    runner = ModelRunner.from_pretrained(
        folder, ExecutorConfig(dtype="float32", max_num_seqs=1, max_model_len=total + 16, block_size=BLOCK_SIZE,
                               num_kv_blocks=blocks, max_num_batched_tokens=max(length, context))
    )
    prompt = np.random.default_rng(seed).integers(0, VOCAB, size=total).tolist()
    seconds: dict[str, list[float]] = {name: [] for name in backends}
    tokens: dict[str, int] = {}
    planner = HandPlanner(block_size=BLOCK_SIZE, num_blocks=blocks, max_rows=1)
    for index in range(repeats + 1):  # the first round warms up
        for name, backend in backends.items():
            runner.attention_backend = backend
            seq = planner.add(prompt, SamplingParams(temperature=0.0))
            if context:
                plan = planner.next_plan(max_chunk=context)
                planner.record(plan, runner.execute(plan).sampled_token_ids)
            plan = planner.next_plan(max_chunk=length)
            start = time.perf_counter()
            out = runner.execute(plan)
            elapsed = time.perf_counter() - start
            planner.record(plan, out.sampled_token_ids)
            tokens[name] = planner.output_tokens(seq)[0]
            planner.finish(seq)
            if index:
                seconds[name].append(elapsed)
    return {name: length / statistics.median(times) for name, times in seconds.items()}, tokens


def prefill_figures(folder: Path, length: int, repeats: int) -> dict:
    """Prefill tokens/s of one ``length``-token prompt in one step, expanded and absorbed."""
    backends = {"expanded": MlaSdpaBackend(expand_prefill=True), "absorbed": MlaSdpaBackend(expand_prefill=False)}
    rate, tokens = timed_chunks(folder, length, 0, backends, repeats, seed=5)
    return {
        "prefill_tokens": length,
        "prefill_tokens_per_s_expanded": round(rate["expanded"], 1),
        "prefill_tokens_per_s_absorbed": round(rate["absorbed"], 1),
        "prefill_expanded_over_absorbed": round(rate["expanded"] / rate["absorbed"], 2),
        "prefill_same_token": tokens["expanded"] == tokens["absorbed"],
    }


def chunk_figures(folder: Path, length: int, context: int, repeats: int) -> dict:
    """Tokens/s of a ``length``-token chunk after ``context`` cached tokens: expanded in
    slices of ``DEFAULT_SLICE_ROWS`` rows (what pyengine runs), expanded whole (every
    context row at once, what ran before the slices), and absorbed."""
    total = context + length
    backends = {"sliced": MlaSdpaBackend(), "whole": MlaSdpaBackend(slice_rows=total),
                "absorbed": MlaSdpaBackend(expand_prefill=False)}
    rate, tokens = timed_chunks(folder, length, context, backends, repeats, seed=6)
    return {
        "chunk_tokens": length,
        "chunk_context": context,
        "chunk_rows_expanded_at_once_sliced": min(DEFAULT_SLICE_ROWS, total),
        "chunk_rows_expanded_at_once_whole": total,
        **{f"chunk_tokens_per_s_{name}": round(value, 1) for name, value in rate.items()},
        "chunk_sliced_over_whole": round(rate["sliced"] / rate["whole"], 2),
        "chunk_sliced_over_absorbed": round(rate["sliced"] / rate["absorbed"], 2),
        "chunk_same_token": tokens["sliced"] == tokens["whole"] == tokens["absorbed"],
    }


def absorbed_chunk_figures(heads: int, length: int, context: int, repeats: int) -> dict:
    """One layer's attention (``MlaStepAttention.attend_mla``) of a ``length``-token chunk
    after ``context`` cached latent rows, random, at ``MODEL``'s head sizes with ``heads``
    heads: a chunk that short stays absorbed (``expands``). Its context in slices of
    ``DEFAULT_SLICE_ROWS`` rows (what pyengine runs) against whole (``slice_rows`` past the
    context: the one SDPA call over every row that ran before): seconds per call (medians
    of alternating calls) and the peak bytes of the call's temporaries."""
    rank, rope, nope, v = MODEL["kv_lora_rank"], MODEL["qk_rope_head_dim"], MODEL["qk_nope_head_dim"], MODEL["v_head_dim"]
    total = context + length
    blocks = -(-total // BLOCK_SIZE)
    rng = torch.Generator().manual_seed(7)
    cache = LatentKVCache(LatentKVCacheShape(1, rank + rope, rank, BLOCK_SIZE, torch.float32), blocks, torch.device("cpu"))
    cache.latents.copy_(torch.randn(cache.latents.shape, generator=rng))
    layout = StepAttentionLayout(
        query_start_loc=np.array([0, length]), seq_lens=np.array([total]), num_scheduled_tokens=np.array([length]),
        slot_mapping=torch.arange(context, total), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        block_size=BLOCK_SIZE,
    )
    queries = LatentQueries(torch.randn(length, heads, nope, generator=rng), torch.randn(length, heads, rope, generator=rng),
                            torch.randn(heads, nope, rank, generator=rng) * rank**-0.5,
                            torch.randn(heads, v, rank, generator=rng) * rank**-0.5)
    latent = torch.randn(length, rank + rope, generator=rng)
    slices = {"sliced": DEFAULT_SLICE_ROWS, "whole": total}

    def call(name: str) -> torch.Tensor:
        step = MlaStepAttention(cache, layout, slice_rows=slices[name])
        assert not expands(step.chunks[0], queries)
        return step.attend_mla(0, queries, latent, (nope + rope) ** -0.5)

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
        "absorbed_chunk_heads": heads,
        "absorbed_chunk_tokens": length,
        "absorbed_chunk_context": context,
        **{f"absorbed_chunk_ms_{name}": round(value, 1) for name, value in ms.items()},
        **{f"absorbed_chunk_peak_MiB_{name}": round(value / 2**20, 1) for name, value in peak.items()},
        "absorbed_chunk_sliced_over_whole_time": round(ms["sliced"] / ms["whole"], 2),
        "absorbed_chunk_max_abs_difference": float((outputs["sliced"] - outputs["whole"]).abs().max()),
    }


def kv_figures(runner: ModelRunner) -> dict:
    config, shape = runner.loaded.config, runner.kv_shape
    mla = config.mla
    latent = shape.bytes_per_block // (shape.block_size * shape.num_layers)
    expanded = config.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim) * 4
    # Expanded K and V have different head sizes; as one KVCacheShape: K and V of their mean width.
    expanded_shape = KVCacheShape(config.num_hidden_layers, config.num_attention_heads,
                                  (mla.qk_head_dim + mla.v_head_dim) // 2, BLOCK_SIZE, torch.float32)
    most = 1 << 40
    return {
        "latent_bytes_per_token_per_layer": latent,
        "expanded_bytes_per_token_per_layer": expanded,
        "expanded_over_latent": round(expanded / latent, 2),
        "blocks_per_GiB_latent": blocks_for_budget(shape, BUDGET, most),
        "blocks_per_GiB_expanded": blocks_for_budget(expanded_shape, BUDGET, most),
        "implied_by_published": {
            name: round(heads * (nope + rope + v) / (rank + rope), 1)
            for name, (heads, nope, rope, v, rank) in PUBLISHED.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps of each kind")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prefill", type=int, default=1024, help="prompt tokens of the prefill figures (0: skip)")
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--chunk-context", type=int, default=2048,
                        help="cached tokens before a --prefill-token chunk, for the chunk figures (0: skip)")
    parser.add_argument("--absorbed-context", type=int, default=16384,
                        help="cached rows before an --absorbed-tokens chunk, one layer's attention (0: skip)")
    parser.add_argument("--absorbed-tokens", type=int, default=64)
    parser.add_argument("--absorbed-heads", type=int, default=MODEL["num_attention_heads"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_checkpoint(Path(tmp) / "mla", "deepseek_v2", vocab_size=VOCAB, seed=0, **MODEL)
        absorbed = Decoder(folder, args.batch, args.context, expanded=False)
        expanded = Decoder(folder, args.batch, args.context, expanded=True)
        times: dict[str, list[float]] = {"absorbed": [], "expanded": []}
        agree = total = 0
        for index in range(args.steps + 2):  # 2 warm-up steps each
            a, e = absorbed.step(), expanded.step()
            agree += sum(x == y for x, y in zip(absorbed.last_tokens, expanded.last_tokens))
            total += len(absorbed.last_tokens)
            if index >= 2:
                times["absorbed"].append(a)
                times["expanded"].append(e)
        kv = kv_figures(absorbed.runner)
        del absorbed, expanded
        prefill = prefill_figures(folder, args.prefill, args.prefill_repeats) if args.prefill else {}
        chunk = {}
        if args.prefill and args.chunk_context:
            chunk = chunk_figures(folder, args.prefill, args.chunk_context, args.prefill_repeats)
    absorbed_chunk = {}
    if args.absorbed_context:
        absorbed_chunk = absorbed_chunk_figures(args.absorbed_heads, args.absorbed_tokens, args.absorbed_context,
                                                args.prefill_repeats)
    absorbed_ms = statistics.median(times["absorbed"]) * 1e3
    expanded_ms = statistics.median(times["expanded"]) * 1e3
    result = {
        "workload": {"batch": args.batch, "context": args.context, "steps": args.steps, "threads": args.threads},
        "model": {**MODEL, "vocab_size": VOCAB},
        **kv,
        "decode_batch": args.batch,
        "decode_context": args.context,
        "decode_step_ms_absorbed": round(absorbed_ms, 2),
        "decode_step_ms_expanded": round(expanded_ms, 2),
        "decode_expanded_over_absorbed": round(expanded_ms / absorbed_ms, 2),
        # The two forms are the same function: their greedy tokens agree (bar float ties).
        "decode_tokens_agree": f"{agree}/{total}",
        **prefill,
        **chunk,
        **absorbed_chunk,
        "note": "shared, noisy machine: medians of alternating steps",
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"KV per token and layer: latent {kv['latent_bytes_per_token_per_layer']} B, expanded K/V "
          f"{kv['expanded_bytes_per_token_per_layer']} B ({kv['expanded_over_latent']}x); blocks per GiB: "
          f"{kv['blocks_per_GiB_latent']} vs {kv['blocks_per_GiB_expanded']}")
    print(f"implied by published dims: {kv['implied_by_published']}")
    print(f"decode, batch {args.batch}, context {args.context} ({args.threads} threads): absorbed "
          f"{absorbed_ms:.2f} ms/step, expanded {expanded_ms:.2f} ms/step ({result['decode_expanded_over_absorbed']}x); "
          f"greedy tokens agree {result['decode_tokens_agree']}")
    if prefill:
        print(f"prefill, one prompt of {args.prefill} tokens: expanded {prefill['prefill_tokens_per_s_expanded']} "
              f"tokens/s, absorbed {prefill['prefill_tokens_per_s_absorbed']} tokens/s "
              f"({prefill['prefill_expanded_over_absorbed']}x); same first token: {prefill['prefill_same_token']}")
    if chunk:
        print(f"chunk of {args.prefill} tokens after {args.chunk_context} cached: tokens/s sliced "
              f"{chunk['chunk_tokens_per_s_sliced']} ({chunk['chunk_rows_expanded_at_once_sliced']} rows expanded at "
              f"once), whole {chunk['chunk_tokens_per_s_whole']} ({chunk['chunk_rows_expanded_at_once_whole']} rows), "
              f"absorbed {chunk['chunk_tokens_per_s_absorbed']}; sliced/whole {chunk['chunk_sliced_over_whole']}x, "
              f"sliced/absorbed {chunk['chunk_sliced_over_absorbed']}x; same first token: {chunk['chunk_same_token']}")

    if absorbed_chunk:
        c = absorbed_chunk
        print(f"absorbed chunk of {args.absorbed_tokens} tokens after {args.absorbed_context} cached rows, "
              f"{args.absorbed_heads} heads, one layer: sliced {c['absorbed_chunk_ms_sliced']} ms, peak "
              f"{c['absorbed_chunk_peak_MiB_sliced']} MiB; whole {c['absorbed_chunk_ms_whole']} ms, peak "
              f"{c['absorbed_chunk_peak_MiB_whole']} MiB; max |sliced - whole| {c['absorbed_chunk_max_abs_difference']:.2e}")


if __name__ == "__main__":
    main()
