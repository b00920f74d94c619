"""Tensor parallelism on CPU: the same offline workload at TP=1 (one process, 2 threads)
and TP=2 (rank 0 in the engine plus one worker process, 1 thread each, gloo).

Model: the bench-sized checkpoint of ``benches/throughput.py`` (Qwen3-shaped, hidden 256,
4 layers, 4 heads / 2 KV heads, vocab 4096, float32). Workload: ``--num-requests`` random
prompts of 64-512 tokens, outputs of 64-256 tokens, greedy, ignore_eos.

Prints output tokens/s at each size and their ratio (and TP=1 on one thread, to tell the
split from the threading; and TP=2 with ``disable_custom_all_reduce=True``, every
collective through gloo, to show what the shared-memory path buys), and per step at TP=2:
- ``broadcast_us_per_step``: rank 0 filling the placeholders, writing the plan into
  shared memory and waking the worker (measured inside the engine, every step), wall
  time, and ``broadcast_cpu_us_per_step`` the executor thread's CPU time for it (the wall
  time also counts being descheduled when the host is busier than its cores);
- ``all_reduce_us_per_step``: the step's all-reduces (1 + 2 x layers, each [tokens, hidden])
  timed alone between two processes through the engine's shared-memory path, at the
  workload's largest decode batch (``gloo_all_reduce_us_per_step``: the same through gloo);
- ``gather_us_per_step``: the logits gather (vocabulary slices plus status) timed alike
  (``gloo_gather_us_per_step``).

Bars: ratio >= 0.8; broadcast <= 100 us per step. The machine is shared: run the sizes
alternately (``--repeats``) and read the medians.

    python benches/tp.py [--json] [--num-requests N] [--max-num-seqs N] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import MODEL, VOCAB_SIZE, bench_checkpoint  # noqa: E402
from thread_collapse import thread_collapse_warning  # noqa: E402
from throughput import workload  # noqa: E402

from pyengine import LLM, SamplingParams  # noqa: E402
from pyengine.testing.waits import free_port  # noqa: E402


def run_engine(folder: Path, tp: int, prompts, outputs, max_num_seqs: int, threads: int = 2,
               gloo: bool = False) -> tuple[float, dict]:
    torch.set_num_threads(threads)
    with LLM(str(folder), dtype="float32", max_num_seqs=max_num_seqs, max_model_len=1024,
             tensor_parallel_size=tp, disable_custom_all_reduce=gloo) as llm:
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        runner = llm.engine_core.runner
        if tp > 1:
            runner.broadcast_seconds, runner.broadcast_cpu_seconds, runner.steps = 0.0, 0.0, 0
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outputs]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        stats = llm.stats()
        extra = {"steps": stats.steps, "step_ms_mean": round(stats.step_time_mean_ms, 2)}
        if tp > 1:
            extra["broadcast_us_per_step"] = round(runner.stats()["broadcast_s_per_step"] * 1e6, 1)
            extra["broadcast_cpu_us_per_step"] = round(runner.stats()["broadcast_cpu_s_per_step"] * 1e6, 1)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    return produced / elapsed, extra


def collective_rank(rank: int, port: int, tokens: int, hidden: int, vocab_rows: int, count: int, iters: int) -> None:
    """One of two ranks timing a step's all-reduces and its gather, through gloo and
    through the engine's shared-memory path (rank 0 prints)."""
    from pyengine.executor.tensor_parallel.host_collectives import HostCollectives
    from pyengine.executor.tensor_parallel.rendezvous import Rendezvous, join_group, leave_group

    torch.set_num_threads(1)
    store = join_group(Rendezvous("127.0.0.1", port, rank, 2, rank, "gloo", timeout_s=60.0))
    if rank == 0:
        local = HostCollectives(0, 2, timeout_s=60.0)
        store.set("bench/segment", local.name)
    else:
        local = HostCollectives(1, 2, timeout_s=60.0, name=store.get("bench/segment").decode())
    torch.distributed.barrier()
    local.unlink()
    x = torch.randn(tokens, hidden)
    flat = torch.randn(tokens * vocab_rows + 1)
    parts = torch.empty(2, flat.numel()) if rank == 0 else None
    paths = {
        "gloo": (lambda: torch.distributed.all_reduce(x),
                 lambda: torch.distributed.gather(flat, None if parts is None else list(parts), dst=0)),
        "shm": (lambda: local.all_reduce(x), lambda: local.gather(flat, parts)),
    }
    result = {}
    for name, (reduce, gather) in paths.items():
        for _ in range(5):
            reduce()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(iters * count):
            reduce()
        result[name + "_all_reduce"] = (time.perf_counter() - t0) / iters
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            gather()
        result[name + "_gather"] = (time.perf_counter() - t0) / iters
        torch.distributed.barrier()
    if rank == 0:
        print(json.dumps({
            "all_reduce_us_per_step": round(result["shm_all_reduce"] * 1e6, 1),
            "gather_us_per_step": round(result["shm_gather"] * 1e6, 1),
            "gloo_all_reduce_us_per_step": round(result["gloo_all_reduce"] * 1e6, 1),
            "gloo_gather_us_per_step": round(result["gloo_gather"] * 1e6, 1),
        }))
    local.close()
    leave_group(store, rank, 2)


def time_collectives(tokens: int, iters: int = 200) -> dict:
    port = free_port()
    count = 1 + 2 * MODEL["num_hidden_layers"]
    vocab_rows = VOCAB_SIZE // 2
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--collective-rank", str(rank), "--port", str(port),
                               "--tokens", str(tokens), "--iters", str(iters)], env=env,
                              stdout=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        out = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    result = json.loads(out[0].strip().splitlines()[-1])
    result.update(tokens_per_step=tokens, all_reduces_per_step=count, hidden=MODEL["hidden_size"],
                  vocab_rows_per_rank=vocab_rows)
    return result


def threading_warnings(two_threads: float, one_thread: float) -> list[str]:
    """A warning when TP=1 on 2 threads (tokens/s) was slower than on 1 thread: the host is
    oversubscribed and the ratio against 2 threads measures OpenMP's spin-wait, not TP."""
    if two_threads >= one_thread:
        return []
    return [thread_collapse_warning(f"TP=1 on 2 threads ({two_threads:.1f} tokens/s) was slower than on "
                                    f"1 thread ({one_thread:.1f})")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--collective-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=200, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collective_rank is not None:
        collective_rank(args.collective_rank, args.port, args.tokens, MODEL["hidden_size"], VOCAB_SIZE // 2,
                        1 + 2 * MODEL["num_hidden_layers"], args.iters)
        return
    logging.basicConfig(level=logging.WARNING)
    prompts, outputs = workload(args.num_requests, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_checkpoint(Path(tmp) / "model")
        runs: dict[int, list] = {1: [], 2: []}
        one_thread = []  # TP=1 on one core: how much of the ratio is the split, how much threading
        gloo = []  # TP=2 with every collective through gloo (disable_custom_all_reduce)
        for _ in range(max(1, args.repeats)):
            for tp in (1, 2):
                runs[tp].append(run_engine(folder, tp, prompts, outputs, args.max_num_seqs))
            one_thread.append(run_engine(folder, 1, prompts, outputs, args.max_num_seqs, threads=1)[0])
            gloo.append(run_engine(folder, 2, prompts, outputs, args.max_num_seqs, gloo=True)[0])
    tps = {tp: statistics.median(r[0] for r in results) for tp, results in runs.items()}
    warnings = threading_warnings(tps[1], statistics.median(one_thread))
    collectives = time_collectives(tokens=args.max_num_seqs)
    broadcast = statistics.median(r[1]["broadcast_us_per_step"] for r in runs[2])
    broadcast_cpu = statistics.median(r[1]["broadcast_cpu_us_per_step"] for r in runs[2])
    result = {
        "tp1_tokens_per_s": round(tps[1], 1),
        "tp2_tokens_per_s": round(tps[2], 1),
        "ratio": round(tps[2] / tps[1], 3),
        "tp1_one_thread_tokens_per_s": round(statistics.median(one_thread), 1),
        "ratio_to_one_thread": round(tps[2] / statistics.median(one_thread), 3),
        "tp2_gloo_tokens_per_s": round(statistics.median(gloo), 1),
        "broadcast_us_per_step": broadcast,
        "broadcast_cpu_us_per_step": broadcast_cpu,
        **{k: v for k, v in collectives.items()},
        "bars": {"ratio >= 0.8": tps[2] / tps[1] >= 0.8, "broadcast <= 100 us": broadcast <= 100},
        "load_average_1min": round(os.getloadavg()[0], 2),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(libgomp default)"),
        "warnings": warnings,
        "details": {f"tp{tp}": [{"tokens_per_s": round(r[0], 1), **r[1]} for r in results]
                    for tp, results in runs.items()},
        "workload": {"requests": args.num_requests, "output_tokens": int(np.sum(outputs)),
                     "max_num_seqs": args.max_num_seqs},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key in ("tp1_tokens_per_s", "tp2_tokens_per_s", "ratio", "tp1_one_thread_tokens_per_s",
                    "ratio_to_one_thread", "tp2_gloo_tokens_per_s", "broadcast_us_per_step",
                    "broadcast_cpu_us_per_step", "all_reduce_us_per_step", "gloo_all_reduce_us_per_step",
                    "gather_us_per_step", "gloo_gather_us_per_step", "load_average_1min", "omp_wait_policy"):
            print(f"{key:<28} {result[key]}")
        for warning in warnings:
            print(warning)
        print(f"bars: {result['bars']}")


if __name__ == "__main__":
    main()
