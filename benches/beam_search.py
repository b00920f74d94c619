"""Beam search: what sharing blocks through the prefix cache buys, and where it stands
against transformers' ``generate(num_beams=k)``.

Model: the bench-sized Qwen3-shaped random checkpoint of ``throughput.py`` (hidden 256,
4 layers, vocab 4096, float32, CPU). Workload: ``--num-prompts`` random prompts
(``--prompt-len`` tokens), ``--beam-width`` beams, ``--max-tokens`` steps (``ignore_eos``,
so every run does the same steps).

- ``cached``: ``LLM.beam_search`` with prefix caching on (the default): each step's
  requests find the blocks their beams share in the cache.
- ``uncached``: the same with ``enable_prefix_caching=False``: every step recomputes
  every beam's whole sequence.
- ``transformers``: ``generate(num_beams=k, num_return_sequences=k)`` one prompt at a
  time (its beams share a reordered KV cache; no paging).

Reported: seconds per run (median of ``--repeats``), prompt tokens the engine computed
(``prefill_tokens_scheduled``) and the prefix-cache hit rate of each engine run, the
ratios, and whether the three return the same sequences.

    python benches/beam_search.py [--json] [--num-prompts 8] [--prompt-len 192] [--beam-width 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from bench_model import bench_checkpoint

from pyengine import LLM, BeamSearchParams


def run_engine(folder: Path, prompts, params: BeamSearchParams, repeats: int, **engine_args) -> dict:
    times, computed, hit_rate, sequences = [], 0, 0.0, None
    with LLM(str(folder), **engine_args) as llm:
        llm.beam_search(prompts[:1], BeamSearchParams(beam_width=params.beam_width, max_tokens=2))  # warm-up
        for _ in range(repeats):
            before = llm.stats().scheduler
            start = time.perf_counter()
            outs = llm.beam_search(prompts, params)
            times.append(time.perf_counter() - start)
            after = llm.stats().scheduler
            computed = int(after["prefill_tokens_scheduled"] - before["prefill_tokens_scheduled"])
            queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
            hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
            hit_rate = hits / queried if queried else 0.0
            sequences = [[s.output_token_ids for s in o.sequences] for o in outs]
    return {"seconds": statistics.median(times), "prompt_tokens_computed": computed,
            "prefix_cache_hit_rate": round(hit_rate, 3), "sequences": sequences}


def run_transformers(folder: Path, prompts, params: BeamSearchParams, repeats: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
    k = params.beam_width
    times, sequences = [], None
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            sequences = []
            for p in prompts:
                out = model.generate(torch.tensor([p]), num_beams=k, num_return_sequences=k, do_sample=False,
                                     max_new_tokens=params.max_tokens,
                                     length_penalty=params.length_penalty, pad_token_id=0)
                sequences.append([out[i, len(p):].tolist() for i in range(k)])
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "sequences": sequences}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4000, args.prompt_len).tolist() for _ in range(args.num_prompts)]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_checkpoint(Path(tmp) / "model")
        cached = run_engine(folder, prompts, params, args.repeats)
        uncached = run_engine(folder, prompts, params, args.repeats, enable_prefix_caching=False)
        reference = run_transformers(folder, prompts, params, args.repeats)
    result = {
        "workload": {k: v for k, v in vars(args).items() if k != "json"},
        "cached": {k: v for k, v in cached.items() if k != "sequences"},
        "uncached": {k: v for k, v in uncached.items() if k != "sequences"},
        "transformers_s": reference["seconds"],
        "uncached_over_cached_time": round(uncached["seconds"] / cached["seconds"], 2),
        "transformers_over_cached_time": round(reference["seconds"] / cached["seconds"], 2),
        "same_sequences": cached["sequences"] == uncached["sequences"] == reference["sequences"],
    }
    if args.json:
        print(json.dumps(result))
        return
    for name in ("cached", "uncached"):
        r = result[name]
        print(f"{name:>12}: {r['seconds']:.2f} s, {r['prompt_tokens_computed']} prompt tokens computed, "
              f"prefix-cache hit rate {r['prefix_cache_hit_rate']:.0%}")
    print(f"{'transformers':>12}: {reference['seconds']:.2f} s")
    print(f"uncached / cached time {result['uncached_over_cached_time']}, "
          f"transformers / cached time {result['transformers_over_cached_time']}, "
          f"same sequences: {result['same_sequences']}")


if __name__ == "__main__":
    main()
