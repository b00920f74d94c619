"""Offline throughput: pyengine next to transformers and a plain PyTorch lower bound.

Model: Qwen3-shaped random checkpoint (hidden 256, 4 layers, 4 heads / 2 KV heads,
vocab 4096, float32, CPU). Workload: ``--num-requests`` prompts of ``--prompt-range``
(default 64-512) random tokens, each asking for one of four output lengths spread over
``--output-range`` (default 64-256), ignore_eos, greedy, fixed seed.
Measured in one run, output tokens per second:

- ``pyengine``: ``LLM.generate`` on the whole workload (engine start-up not timed).
- ``hf_generate``: transformers' ``generate`` in left-padded static batches of 16 in input
  order; a batch decodes until its longest request is done, and only the tokens each
  request asked for count (what static batching costs).
- ``hf_generate_batch``: transformers' continuous batching (the manager behind
  ``generate_batch``), every request added at once with its own output length, its paged
  cache sized to the workload as pyengine's is (``hf_cache_config``: the ``--max-num-seqs``
  largest requests at once) and built before the timer starts.
- ``lower_bound``: the same tokens through a plain PyTorch loop over a contiguous KV cache
  with perfect batching: total prompt tokens at the measured prefill rate plus total
  output tokens at the measured decode rate of a full batch (``--max-num-seqs``) at the
  workload's mean context. It runs the engine's own model object (same weights, layers
  and matmul kernels); its decode attention is PyTorch's SDPA over the contiguous cache.
  The engine's native decode kernel beats SDPA there, so pyengine can exceed this bound.
- ``lower_bound_native_attention``: the same bound with decode attention by the engine's
  native kernel over the same contiguous cache (one block per sequence). Same kernels
  as the engine, perfect batching, no paging and no scheduler: what pyengine loses to
  it is what the engine adds around the model (batch drain, paging, sampling, threads).

pyengine and the lower bound are measured alternately ``--repeats`` times (a fresh engine
each time, start-up not timed) and each is reported as its median: on a shared machine a
single run of either can land in a slow period of the host. Every repeat's figures are in
the details.

Bars: pyengine >= 75% of ``lower_bound`` and >= 3x the better transformers run.

    python benches/throughput.py [--json] [--num-requests N] [--max-num-seqs N] [--skip-hf]
        [--repeats N] [--prompt-range 64 512] [--output-range 64 256]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_model import bench_checkpoint

from pyengine import LLM, SamplingParams
from pyengine.testing.contiguous_reference import (
    ContiguousKVCache,
    NativeDecodeKVCache,
    contiguous_step,
)


def output_lengths(shortest: int, longest: int) -> tuple[int, ...]:
    """Four output lengths from ``shortest`` to ``longest`` (few distinct lengths, so that
    ``generate_batch``, which takes one length per call, runs the same workload)."""
    return tuple(int(x) for x in np.linspace(shortest, longest, 4))


def workload(n: int, seed: int, prompt_range=(64, 512), output_range=(64, 256)):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 4096, int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist()
               for _ in range(n)]
    outputs = [int(x) for x in rng.choice(output_lengths(*output_range), n)]
    return prompts, outputs


def run_pyengine(folder: Path, prompts, outputs, max_num_seqs: int) -> tuple[float, dict]:
    with LLM(str(folder), dtype="float32", max_num_seqs=max_num_seqs, max_model_len=1024) as llm:
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outputs]
        before = llm.stats()  # the counters are cumulative: start-up and warm-up are taken off
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        stats = llm.stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    return produced / elapsed, timed_stats(before, stats, elapsed)


def timed_stats(before, after, elapsed: float) -> dict:
    """Each engine thread's busy fraction and the steps over the timed run alone: the
    difference of two ``LLM.stats()`` snapshots (their counters count from the engine's
    start). The step time is the engine's mean over its recent steps (a window)."""
    threads = {name: round((v["busy_s"] - before.threads.get(name, {}).get("busy_s", 0.0)) / elapsed, 3)
               for name, v in after.threads.items()}
    return {"thread_busy_fraction": threads, "steps": after.steps - before.steps,
            "step_ms_mean": round(after.step_time_mean_ms, 2)}


def _hf_model(folder: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    return model


def run_hf_generate(folder: Path, prompts, outputs, batch: int = 16) -> float:
    """Static batching as a transformers user does it: batches of 16 in input order, left
    padded, each generating as many tokens as its longest request asks for. Only the
    tokens each request asked for count."""
    model = _hf_model(folder)
    useful, elapsed = 0, 0.0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk, lengths = prompts[i:i + batch], outputs[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lengths), min_new_tokens=max(lengths),
                           do_sample=False, pad_token_id=0)
            elapsed += time.perf_counter() - start
            useful += sum(lengths)
    return useful / elapsed


#: transformers' continuous-batching page: tokens per cache block (its default).
HF_PAGE_SIZE = 256


def hf_cache_config(prompts, outputs, max_num_seqs: int):
    """transformers' continuous-batching cache sized to the workload, as pyengine's is: room
    for the ``max_num_seqs`` largest requests at once, at most ``max_num_seqs`` requests per
    batch. Left to itself it sizes the cache from the machine's memory (all of it on CPU
    without psutil: 14 GB on a 2-core host, and the allocation OOM-killed the bench)."""
    from transformers import ContinuousBatchingConfig

    blocks = sorted((-(-(len(p) + m) // HF_PAGE_SIZE) for p, m in zip(prompts, outputs)), reverse=True)
    return ContinuousBatchingConfig(page_size=HF_PAGE_SIZE, num_blocks=sum(blocks[:max_num_seqs]),
                                    max_batch_tokens=max(1024, max(map(len, prompts))),
                                    max_requests_per_batch=max_num_seqs)


def run_hf_generate_batch(folder: Path, prompts, outputs, max_num_seqs: int, timeout: float = 3600.0) -> float:
    """transformers' continuous batching (the manager ``generate_batch`` uses): every request
    added at once, each with its own output length; the cache is built (and warmed up)
    before the timer starts."""
    from transformers import GenerationConfig

    model = _hf_model(folder)
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)  # no EOS: ignore_eos
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=hf_cache_config(prompts, outputs, max_num_seqs),
            block=True, timeout=30, warmup=True) as manager:
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        for length in sorted(set(outputs)):
            manager.add_requests(inputs=[p for p, m in zip(prompts, outputs) if m == length], max_new_tokens=length)
        total = finished = 0
        while finished < len(prompts):
            if time.monotonic() > deadline or not manager.is_running():
                raise RuntimeError(f"transformers' continuous batching finished {finished} of {len(prompts)} requests")
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                total += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    assert total == sum(outputs), (total, sum(outputs))
    return total / elapsed


def run_lower_bound(folder: Path, prompts, outputs, batch: int) -> tuple[float, float, dict]:
    """Output tokens/s of the two bounds: decode attention by SDPA (plain PyTorch, the bar's
    bound) and by the engine's native kernel over the same contiguous cache."""
    with LLM(str(folder), dtype="float32", max_num_seqs=1, num_kv_blocks=8) as llm:
        model = llm.engine_core.runner.model  # the same weights the engine runs
    mean_context = int(statistics.mean(map(len, prompts)) + statistics.mean(outputs) / 2)
    batch = min(batch, len(prompts))
    gen = torch.Generator().manual_seed(0)
    decode_sdpa = _decode_rate(model, ContiguousKVCache, batch, mean_context, gen)
    decode_native = _decode_rate(model, NativeDecodeKVCache, batch, mean_context, gen)
    prefill_len, prefill_times = 256, []
    for _ in range(3):  # a bound: the best of three, as one run on a shared machine is noisy
        prefill_cache = ContiguousKVCache(model, 8, prefill_len)
        start = time.perf_counter()
        contiguous_step(model, prefill_cache, torch.randint(3, 4096, (8, prefill_len), generator=gen))
        prefill_times.append(time.perf_counter() - start)
    prefill_tps = 8 * prefill_len / min(prefill_times)

    def rate(decode_tps: float) -> float:
        return sum(outputs) / (sum(map(len, prompts)) / prefill_tps + sum(outputs) / decode_tps)

    detail = {"decode_tokens_per_s": round(decode_sdpa), "decode_tokens_per_s_native_attention": round(decode_native),
              "prefill_tokens_per_s": round(prefill_tps), "batch": batch, "mean_context": mean_context}
    return rate(decode_sdpa), rate(decode_native), detail


def _decode_rate(model, cache_type, batch: int, context: int, gen: torch.Generator) -> float:
    """Decode tokens/s of a full batch at ``context``: the median of 20 steps."""
    cache = cache_type(model, batch, context + 40)
    for chunk in torch.randint(3, 4096, (batch, context), generator=gen).split(128, dim=1):
        logits = contiguous_step(model, cache, chunk)
    tokens = logits.argmax(-1, keepdim=True)
    times = []
    for _ in range(23):
        start = time.perf_counter()
        tokens = contiguous_step(model, cache, tokens).argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return batch / statistics.median(times[3:])


def _median_run(runs: list[tuple[float, dict]]) -> tuple[float, dict]:
    """The median run's rate and details, with every run's rate listed."""
    ordered = sorted(runs, key=lambda run: run[0])
    rate, detail = ordered[(len(ordered) - 1) // 2]
    return rate, {**detail, "runs": [round(run[0], 1) for run in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128, help="engine batch cap (and lower-bound batch)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers runs")
    parser.add_argument("--repeats", type=int, default=3, help="alternate pyengine / lower-bound runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-range", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    prompts, outputs = workload(args.num_requests, args.seed, args.prompt_range, args.output_range)
    result: dict = {"num_requests": args.num_requests, "prompt_range": list(args.prompt_range),
                    "output_range": list(args.output_range), "output_tokens": sum(outputs),
                    "prompt_tokens": sum(map(len, prompts)), "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_checkpoint(Path(tmp) / "model")
        bounds, engines = [], []
        for _ in range(max(1, args.repeats)):
            bounds.append(run_lower_bound(folder, prompts, outputs, args.max_num_seqs))
            engines.append(run_pyengine(folder, prompts, outputs, args.max_num_seqs))
        result["lower_bound"], result["lower_bound_detail"] = _median_run([(b[0], b[2]) for b in bounds])
        result["lower_bound_native_attention"] = _median_run([(b[1], {}) for b in bounds])[0]
        result["pyengine"], result["pyengine_detail"] = _median_run(engines)
        if not args.skip_hf:
            result["hf_generate"] = run_hf_generate(folder, prompts, outputs)
            result["hf_generate_batch"] = run_hf_generate_batch(folder, prompts, outputs, args.max_num_seqs)
    for key in ("pyengine", "hf_generate", "hf_generate_batch", "lower_bound", "lower_bound_native_attention"):
        if key in result:
            result[key] = round(result[key], 1)
    result["pyengine_over_lower_bound"] = round(result["pyengine"] / result["lower_bound"], 3)
    result["pyengine_over_native_attention_bound"] = round(
        result["pyengine"] / result["lower_bound_native_attention"], 3
    )
    if "hf_generate" in result:
        result["pyengine_over_best_hf"] = round(result["pyengine"] / max(result["hf_generate"],
                                                                         result["hf_generate_batch"]), 2)
    if args.json:
        print(json.dumps(result))
        return
    for key in ("pyengine", "hf_generate", "hf_generate_batch", "lower_bound", "lower_bound_native_attention"):
        if key in result:
            print(f"{key:>28}: {result[key]:10.1f} output tokens/s")
    print(f"pyengine / lower bound = {result['pyengine_over_lower_bound']:.3f} (bar >= 0.75)")
    print(f"pyengine / lower bound with the native decode kernel = {result['pyengine_over_native_attention_bound']:.3f}")
    if "pyengine_over_best_hf" in result:
        print(f"pyengine / best transformers = {result['pyengine_over_best_hf']:.2f}x (bar >= 3x)")
    print("details:", json.dumps({k: v for k, v in result.items() if k.endswith("detail")}))


if __name__ == "__main__":
    main()
