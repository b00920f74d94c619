"""Batch-1 decode against the machine's memory bandwidth (issue 26, "decode at the limit").

In one run:

- read bandwidth: a plain reduction (``torch.sum``) over a 1 GiB float32 buffer, far larger
  than the caches, best of 5;
- for float32, int8 and int4 weights (``quantization=`` at load) of the Qwen3-0.6B-shaped
  checkpoint (``bench_model.QWEN3_06B_SHAPED``, built on the spot): the time of a
  batch-1 decode step through ``ModelRunner.execute`` (median of ``--steps``), the weight
  bytes it reads per token (every linear and the LM head), and their ratio, the effective
  bandwidth. Bar: >= 0.85 of the read bandwidth for float32 and int8.
- the step's overhead: its time minus the time spent inside its native calls, timed as
  they run in those same steps: each matmul kernel, and each layer's native front
  (``_kernels.DecodeLayer.run``, ``pyengine.models.decode_path``), which holds that layer's
  norms, rotary embedding, K/V write and attention besides its three products;
- the step's process CPU time per thread (``step_cpu_ms``, median): on a shared machine,
  about what the step takes while its threads hold their cores (with one thread; with
  more, OpenMP's spinning waits count too);
- the same step through the modules (the model's native decode path off,
  ``pyengine.models.decode_path``), alternating with the timed steps on the same
  sequences: ``modules_step_ms`` and ``decode_path_speedup``.

Usage: python benches/decode_bandwidth.py [--json] [--steps N] [--threads N] [--methods float32,int8,int4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from bench_model import QWEN3_06B_SHAPED, qwen3_06b_shaped_folder

from pyengine import _kernels
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.decode_path import _LayerProgram
from pyengine.models.layers import ColumnParallelLinear, RowParallelLinear
from pyengine.sampling_params import SamplingParams
from pyengine.testing.hand_plan import HandPlanner

PROMPT_LENGTH = 32
BLOCK_SIZE = 16


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of ``torch.sum`` over a buffer of ``gib`` GiB (best of ``repeats``)."""
    buffer = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    buffer.sum()
    best = min(_timed(buffer.sum) for _ in range(repeats))
    del buffer
    return gib * (1 << 30) / best


def _timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def make_runner(folder: Path, method: str, max_num_seqs: int) -> ModelRunner:
    dtype = "bfloat16" if method == "bfloat16" else "float32"
    quantization: Optional[str] = method if method in ("int8", "int4") else None
    config = ExecutorConfig(dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=1024, block_size=BLOCK_SIZE,
                            num_kv_blocks=max_num_seqs * 512 // BLOCK_SIZE, load_format="dummy",
                            attention_backend="sdpa", quantization=quantization)
    return ModelRunner.from_pretrained(folder, config)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of every matmul weight a decode step reads (linears and the LM head)."""
    total = 0
    for module in model.modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if module.quantized is not None:
            total += module.quantized.nbytes
        else:
            dense = module.gemv_weight if module.gemv_weight is not None else module.weight
            total += dense.numel() * dense.element_size()
    head = model.quantized_head
    total += head.nbytes if head is not None else model.output_embedding.numel() * model.output_embedding.element_size()
    return total


class KernelClock:
    """Time spent inside the native calls while installed: wraps the two product kernels,
    ``_kernels.gemv_f32`` and ``_kernels.gemv_quantized``, which ``pyengine.models.gemv``
    and the decode path call through the module, and the decode path's layer fronts
    (``_LayerProgram._native_front``, around ``_kernels.DecodeLayer.run``: a few
    microseconds of Python each, counted with the call)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def __enter__(self) -> "KernelClock":
        for owner, name in ((_kernels, "gemv_f32"), (_kernels, "gemv_quantized"), (_LayerProgram, "_native_front")):
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)
        self._saved.clear()

    def _wrap(self, original: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def decode_steps(runner: ModelRunner, batch: int, steps: int, clock: Optional[KernelClock] = None,
                 modules: Optional[list[float]] = None, cpu: Optional[list[float]] = None) -> list[float]:
    """``batch`` sequences prefilled with 32 tokens, then ``steps`` timed decode steps
    (after 3 untimed); with ``clock``, the kernel time of the timed steps goes into it.
    With ``modules``, each timed step is followed by one with the model's native decode
    path off (``pyengine.models.decode_path``: the modules run), whose time goes there.
    With ``cpu``, each timed step's process CPU time goes there."""
    vocab = QWEN3_06B_SHAPED["vocab_size"]
    planner = HandPlanner(block_size=BLOCK_SIZE, num_blocks=runner.num_kv_blocks, max_rows=batch, seed=1)
    rng = np.random.default_rng(0)
    for _ in range(batch):
        planner.add(rng.integers(0, vocab, size=PROMPT_LENGTH).tolist(), SamplingParams(temperature=0.0))
    times = []
    for index in range(steps + 4):
        plan = planner.next_plan()
        timed = index >= 4  # the prefill and 3 warm-up steps are not timed
        if timed and clock is not None:
            with clock:
                start, start_cpu = time.perf_counter(), time.process_time()
                out = runner.execute(plan)
                times.append(time.perf_counter() - start)
                if cpu is not None:
                    cpu.append(time.process_time() - start_cpu)
        else:
            start = time.perf_counter()
            out = runner.execute(plan)
            if timed:
                times.append(time.perf_counter() - start)
        planner.record(plan, out.sampled_token_ids)
        if timed and modules is not None:
            path, runner.model.decode_path = runner.model.decode_path, None
            plan = planner.next_plan()
            start = time.perf_counter()
            out = runner.execute(plan)
            modules.append(time.perf_counter() - start)
            runner.model.decode_path = path
            planner.record(plan, out.sampled_token_ids)
    return times


def bench_method(folder: Path, method: str, steps: int, bandwidth: float) -> dict[str, Any]:
    runner = make_runner(folder, method, 1)
    clock = KernelClock()
    modules: list[float] = []
    cpu: list[float] = []
    times = decode_steps(runner, 1, steps, clock, modules, cpu)
    step = statistics.median(times)
    read = weight_bytes_per_token(runner.model)
    kernel = clock.seconds / len(times)
    return {
        "step_ms": round(step * 1e3, 3),
        "tokens_per_s": round(1 / step, 2),
        "weight_bytes_per_token": read,
        "effective_gb_s": round(read / step / 1e9, 2),
        "fraction_of_read_bandwidth": round(read / step / bandwidth, 3),
        "kernel_ms": round(kernel * 1e3, 3),
        "kernel_gb_s": round(read / kernel / 1e9, 2) if kernel > 0 else None,
        "overhead_ms": round((sum(times) / len(times) - kernel) * 1e3, 3),
        "step_cpu_ms": round(statistics.median(cpu) / torch.get_num_threads() * 1e3, 3),
        "modules_step_ms": round(statistics.median(modules) * 1e3, 3),
        "decode_path_speedup": round(statistics.median(modules) / step, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per method")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    parser.add_argument("--methods", default="float32,int8,int4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    results: dict[str, Any] = {"threads": args.threads, "load_average_before": os.getloadavg()[0],
                               "read_bandwidth_gb_s": round(bandwidth / 1e9, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = qwen3_06b_shaped_folder(Path(tmp))
        for method in args.methods.split(","):
            results[method] = bench_method(folder, method, args.steps, bandwidth)
    results["read_bandwidth_after_gb_s"] = round(read_bandwidth() / 1e9, 2)
    results["load_average_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results))
        return
    print(f"read bandwidth {results['read_bandwidth_gb_s']} GB/s (after: {results['read_bandwidth_after_gb_s']}), "
          f"{args.threads} threads, load {results['load_average_before']:.1f}")
    for method in args.methods.split(","):
        r = results[method]
        print(f"{method:9s} {r['tokens_per_s']:7.2f} tok/s  {r['effective_gb_s']:6.2f} GB/s effective "
              f"({r['fraction_of_read_bandwidth']:.2f} of read)  kernels {r['kernel_ms']:.2f} ms  "
              f"overhead {r['overhead_ms']:.2f} ms  (modules: {r['modules_step_ms']:.2f} ms a step)")


if __name__ == "__main__":
    main()
