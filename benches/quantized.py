"""Weight-only quantization side by side (issue 26): float32, bfloat16, int8 and int4
weights of the Qwen3-0.6B-shaped checkpoint (``bench_model.QWEN3_06B_SHAPED``, weights
drawn at load), each in its own child process, one after the other in one run:

- decode tokens/s at batch 1 and at batch 32 (``ModelRunner.execute`` steps after a
  32-token prefill per sequence; median step);
- prefill tokens/s (one 256-token prompt in one step, best of 2);
- memory: the weights' bytes (every tensor the model holds for its matmuls and
  embedding, packed copies included) and the child's resident set after loading.

Bars: int8 decode at batch 1 >= 3x float32, int4 >= 5x; at batch 32 neither below
float32; int4 model memory <= 0.2x float32.

Usage: python benches/quantized.py [--json] [--steps N] [--threads N] [--methods ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_model import QWEN3_06B_SHAPED, qwen3_06b_shaped_folder
from decode_bandwidth import decode_steps, make_runner

from pyengine.sampling_params import SamplingParams
from pyengine.testing.hand_plan import HandPlanner

METHODS = ("float32", "bfloat16", "int8", "int4")
PREFILL_LENGTH = 256


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model keeps (parameters off the meta device, packed
    weights, the dense copies kept for the decode kernels), each storage counted once."""
    seen: dict[int, int] = {}

    def add(tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            if tensor.is_mkldnn:
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
            else:
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()

    for parameter in model.parameters():
        add(parameter)
    for module in model.modules():
        for name in ("packed", "gemv_weight", "packed_head", "gemv_head"):
            add(getattr(module, name, None))
        for pair in (getattr(module, "packed_gate_up", None) or ()):
            add(pair)
        for name in ("quantized", "quantized_head"):
            quantized = getattr(module, name, None)
            if quantized is not None:
                # Any of the linears' weight forms (kernels.LinearWeight: PackedWeight,
                # Fp8Weight, Int8PackWeight, Int4PackWeight): every tensor it holds.
                for tensor in vars(quantized.weight).values():
                    add(tensor)
    return sum(seen.values())


def prefill_tokens_per_s(folder: Path, method: str) -> float:
    vocab = QWEN3_06B_SHAPED["vocab_size"]
    best = float("inf")
    runner = make_runner(folder, method, 1)
    for repeat in range(2):
        planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=1, seed=repeat)
        planner.add(np.random.default_rng(repeat).integers(0, vocab, size=PREFILL_LENGTH).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=1))
        plan = planner.next_plan()
        start = time.perf_counter()
        runner.execute(plan)
        best = min(best, time.perf_counter() - start)
        runner = make_runner(folder, method, 1)  # a fresh KV cache (and prefix state) per repeat
    return PREFILL_LENGTH / best


def one_method(method: str, steps: int) -> dict[str, Any]:
    """Every figure of ``method``, in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = qwen3_06b_shaped_folder(Path(tmp))
        before = resident_bytes()
        runner = make_runner(folder, method, 32)
        loaded = resident_bytes()
        weights = model_bytes(runner.model)
        batch1 = statistics.median(decode_steps(runner, 1, steps))
        del runner
        runner = make_runner(folder, method, 32)
        batch32 = statistics.median(decode_steps(runner, 32, max(4, steps // 2)))
        del runner
        prefill = prefill_tokens_per_s(folder, method)
    return {
        "decode_batch1_tokens_per_s": round(1 / batch1, 2),
        "decode_batch32_tokens_per_s": round(32 / batch32, 1),
        "prefill_tokens_per_s": round(prefill, 1),
        "model_bytes": weights,
        "resident_bytes_after_load": loaded,
        "resident_bytes_of_load": loaded - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=12, help="timed batch-1 decode steps (batch 32: half)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one method, JSON out
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one_method(args.one, args.steps)))
        return
    results: dict[str, Any] = {"threads": args.threads, "load_average_before": os.getloadavg()[0]}
    methods = args.methods.split(",")
    for method in methods:
        child = subprocess.run([sys.executable, __file__, "--one", method, "--steps", str(args.steps),
                                "--threads", str(args.threads)], capture_output=True, text=True, timeout=1800)
        if child.returncode != 0:
            raise SystemExit(f"{method} failed:\n{child.stderr[-3000:]}")
        results[method] = json.loads(child.stdout.strip().splitlines()[-1])
    results["load_average_after"] = os.getloadavg()[0]
    base = results.get("float32")
    if base:
        results["ratios_to_float32"] = {
            method: {
                "decode_batch1": round(results[method]["decode_batch1_tokens_per_s"] / base["decode_batch1_tokens_per_s"], 2),
                "decode_batch32": round(results[method]["decode_batch32_tokens_per_s"] / base["decode_batch32_tokens_per_s"], 2),
                "prefill": round(results[method]["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 2),
                "model_bytes": round(results[method]["model_bytes"] / base["model_bytes"], 3),
            }
            for method in methods
        }
    if args.json:
        print(json.dumps(results))
        return
    print(f"{args.threads} threads, load {results['load_average_before']:.1f} -> {results['load_average_after']:.1f}")
    for method in methods:
        r = results[method]
        print(f"{method:9s} decode b1 {r['decode_batch1_tokens_per_s']:7.2f} tok/s  b32 {r['decode_batch32_tokens_per_s']:7.1f} "
              f"tok/s  prefill {r['prefill_tokens_per_s']:7.1f} tok/s  weights {r['model_bytes'] / 1e6:7.1f} MB  "
              f"RSS {r['resident_bytes_after_load'] / 1e6:7.1f} MB")
    if base:
        print(json.dumps(results["ratios_to_float32"]))


if __name__ == "__main__":
    main()
