"""One workload, offline and through the server: how much of the engine's throughput
serving over HTTP keeps (issue 12's bar: server / offline >= 0.95).

Model: the bench checkpoint of ``throughput.py`` (Qwen3-shaped, hidden 256, 4 layers,
vocab 4096, float32, CPU). Workload: ``--num-prompts`` random prompts of
``--input-len`` tokens, ``--output-len`` tokens each (``ignore_eos``), at most
``--max-concurrency`` in flight. Runs, each a fresh process:

- ``offline``: ``LLM.generate`` pinned to ``--core-cpus``.
- ``mp``: ``pyengine serve`` (engine core in its own process, the default) with the
  engine core on ``--core-cpus`` and the front end plus this load generator on
  ``--client-cpus``. The load generator is ``serve.py``'s lean client (``sse_client.py``).
- ``mp-httpx``: the same with the load generator on httpx, as this bench ran before
  (``sse_client.py`` says why that client held the server's batches half full).
- ``inprocess``: ``pyengine serve --no-multiprocess`` pinned to ``--core-cpus`` (front end
  and engine share it), the load generator on ``--client-cpus``: the layout before.
- ``dp1`` / ``dp2``: one engine core on both CPUs against two cores with one CPU each
  (``--data-parallel-size 2``), front end and load generator unpinned.

Printed per run: output tokens/s, the ratio to offline, TTFT / TPOT / ITL (client side,
as ``serve.py``), and the executor's pipeline bubbles as a fraction of its wall time
during the run (from ``/metrics``; summed over the cores for dp2). Why a ratio is what it
is: tokens per engine step (a batch half full wastes the engine), the engine's mean TTFT
(from its arrival at the core: the client's TTFT less this is the time spent before the
core), each engine thread's busy microseconds per output token, and the CPU the front
end and the load generator spend per output token. On a shared machine the engine may
get a different share of its CPU in each run: the CPU share it got, and tokens per CPU
second of the engine's process(es) (its ratio to offline's), say how much. The last line
(``summary``; with ``--json`` the ``summary`` key) has the issue's figures together.

    python benches/serve_vs_offline.py [--modes offline,mp,mp-httpx,inprocess,dp1,dp2] [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from pyengine.testing.serve_process import ServeProcess
from pyengine.testing.waits import child_pids

BENCHES = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHES))
import serve  # noqa: E402 - the load generator and report of benches/serve.py
from bench_model import bench_checkpoint  # noqa: E402 - the benches' model
from thread_collapse import thread_collapse_warning  # noqa: E402 - the oversubscribed-host warning

ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "1024"]


def _cpus(text: str) -> list[int]:
    return [int(c) for c in text.split(",")]


def offline_child(args: argparse.Namespace) -> None:
    """In its own process, pinned before torch starts: ``LLM.generate`` over the workload."""
    os.sched_setaffinity(0, _cpus(args.core_cpus))
    from pyengine import LLM, SamplingParams

    prompts = _prompts(args)
    with LLM(args.model_dir, dtype="float32", max_num_seqs=args.max_concurrency, max_model_len=1024) as llm:
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        before = llm.stats()
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        cpu = time.process_time()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        after = llm.stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    report = {"output_throughput": produced / elapsed, "duration_s": elapsed, "total_output_tokens": produced,
              "core_cpu_share": cpu / elapsed, "tokens_per_core_cpu_s": produced / cpu}
    report.update(_engine_figures(_stats_figures(before), _stats_figures(after), produced))
    print(json.dumps(report))


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    import random

    rng = random.Random(args.seed)
    return [[rng.randrange(3, 4096) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--offline-child", "--model-dir", args.model_dir,
           *_workload_flags(args), "--core-cpus", args.core_cpus]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _workload_flags(args: argparse.Namespace) -> list[str]:
    return ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed)]


_SAMPLE = re.compile(r'^(pyengine:[a-z_]+)(?:\{([^}]*)\})? ([0-9.eE+-]+)$')
_THREAD = re.compile(r'thread="([^"]+)"')


def _scrape(url: str) -> dict[str, float]:
    """The server's figures this bench reads, summed over the engine cores: the executor's
    pipeline bubbles and wall time, each engine thread's busy seconds, steps, generated
    tokens, and the sum and count of the engine-side latency histograms."""
    figures: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        name = name.removesuffix("_total")
        thread = _THREAD.search(labels)
        if name in ("pyengine:thread_busy_seconds", "pyengine:thread_idle_seconds") and thread:
            key = f"busy:{thread.group(1)}" if name.endswith("busy_seconds") else f"idle:{thread.group(1)}"
        elif name in ("pyengine:pipeline_bubble_seconds", "pyengine:engine_steps", "pyengine:generation_tokens") or (
                name.endswith(("_seconds_sum", "_seconds_count")) and "le=" not in labels):
            key = name.removeprefix("pyengine:")
        else:
            continue
        figures[key] = figures.get(key, 0.0) + value
    return figures


def _engine_figures(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, Any]:
    """What the engine did between two scrapes (or two ``EngineStats``, as ``_stats_figures``
    spells them): bubbles as a fraction of the executor's wall time, its busy fraction,
    tokens per step, and each engine thread's busy microseconds per output token."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    wall = d.get("busy:pyengine-exec", 0.0) + d.get("idle:pyengine-exec", 0.0)
    steps = d.get("engine_steps", 0.0)
    return {
        "bubble_fraction": d.get("pipeline_bubble_seconds", 0.0) / wall if wall else 0.0,
        # Low busy with few bubbles: the executor waited for requests (the front end or
        # the load generator is the bottleneck), not for plans.
        "exec_busy_fraction": d.get("busy:pyengine-exec", 0.0) / wall if wall else 0.0,
        "tokens_per_step": d.get("generation_tokens", 0.0) / steps if steps else 0.0,
        "steps": steps,
        "thread_busy_us_per_token": {k.removeprefix("busy:"): 1e6 * v / tokens for k, v in sorted(d.items())
                                     if k.startswith("busy:") and tokens},
    }


def _mean(before: dict[str, float], after: dict[str, float], histogram: str) -> float:
    count = after.get(f"{histogram}_count", 0.0) - before.get(f"{histogram}_count", 0.0)
    total = after.get(f"{histogram}_sum", 0.0) - before.get(f"{histogram}_sum", 0.0)
    return total / count if count else 0.0


def _stats_figures(stats: Any) -> dict[str, float]:
    """An offline engine's ``EngineStats`` as ``_scrape`` names the server's figures."""
    figures = {"pipeline_bubble_seconds": stats.pipeline_bubble_s, "engine_steps": float(stats.steps),
               "generation_tokens": float(stats.generated_tokens)}
    for thread, t in stats.threads.items():
        figures[f"busy:{thread}"], figures[f"idle:{thread}"] = t["busy_s"], t["idle_s"]
    return figures


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_server(args: argparse.Namespace, serve_flags: list[str], front_cpus: Optional[list[int]],
               client_cpus: Optional[list[int]], client: str = "lean") -> dict[str, Any]:
    pin = (lambda: os.sched_setaffinity(0, front_cpus)) if front_cpus else None
    server = ServeProcess([args.model_dir, "--no-log-requests", "--stats-interval", "0", "--log-level", "warning",
                           "--max-num-seqs", str(args.max_concurrency), *ENGINE_ARGS, *serve_flags],
                          preexec_fn=pin)  # only sched_setaffinity, before exec
    url, proc = server.url, server.proc
    mine = os.sched_getaffinity(0)
    try:
        server.wait_up(300.0)
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        load = argparse.Namespace(num_prompts=args.num_prompts, request_rate=float("inf"),
                                  max_concurrency=args.max_concurrency, input_len=args.input_len,
                                  output_len=args.output_len, range_ratio=0.0, vocab=4096, min_token_id=3,
                                  warmup=2, timeout=600.0, seed=args.seed, model=None,
                                  client=client)
        # The engine's CPU time: its core processes', or (in-process) the server's own.
        cores = child_pids(proc.pid) or [proc.pid]
        front = [proc.pid] if cores != [proc.pid] else []
        scrape0 = _scrape(url)
        cpu0 = [_cpu_seconds(p) for p in cores + front] + [time.process_time()]
        start = time.perf_counter()
        report = asyncio.run(serve.run(load, url))
        elapsed = time.perf_counter() - start
        cpu1 = [_cpu_seconds(p) for p in cores + front] + [time.process_time()]
        scrape1 = _scrape(url)
        used = [b - a for a, b in zip(cpu0, cpu1)]
        core_cpu = sum(used[:len(cores)])
        # On a shared machine the engine may get much less than its CPUs: tokens per CPU
        # second of the engine compares runs that got different shares.
        report["core_cpu_share"] = core_cpu / elapsed / len(cores)
        report["tokens_per_core_cpu_s"] = report["total_output_tokens"] / core_cpu if core_cpu else 0.0
        tokens = report["total_output_tokens"]
        report["front_end_cpu_s"] = sum(used[len(cores):-1])
        report["client_cpu_s"] = used[-1]
        # The CPU the front end and the load generator (sharing --client-cpus) spend per token.
        report["front_end_cpu_us_per_token"] = 1e6 * report["front_end_cpu_s"] / tokens if tokens else 0.0
        report["client_cpu_us_per_token"] = 1e6 * report["client_cpu_s"] / tokens if tokens else 0.0
        report.update(_engine_figures(scrape0, scrape1, tokens))
        # Arrival at the engine core to its first token, and to being scheduled: the client's
        # TTFT less this is what the request spent in the client, on the wire and in the
        # front end before reaching the core (and its first token on the way back).
        report["engine_mean_ttft_ms"] = 1e3 * _mean(scrape0, scrape1, "time_to_first_token_seconds")
        report["engine_mean_queue_ms"] = 1e3 * _mean(scrape0, scrape1, "request_queue_time_seconds")
        report["outside_engine_ttft_ms"] = report["mean_ttft_ms"] - report["engine_mean_ttft_ms"]
        return report
    finally:
        os.sched_setaffinity(0, mine)
        server.stop(60.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="offline,mp,mp-httpx,inprocess,dp1,dp2")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--core-cpus", default="0", help="the engine core's CPUs (default: %(default)s)")
    parser.add_argument("--client-cpus", default="1", help="front end + load generator (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the modes this many times, interleaved; the repeat with the median "
                             "server / offline ratio is reported, every repeat's ratio with it")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_child:
        offline_child(args)
        return 0
    core, client = _cpus(args.core_cpus), _cpus(args.client_cpus)
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = str(bench_checkpoint(Path(tmp) / "model"))
        both = ",".join(map(str, core + client))
        plans = {
            "offline": lambda: run_offline(args),
            "mp": lambda: run_server(args, ["--engine-core-cpus", args.core_cpus], client, client),
            "mp-httpx": lambda: run_server(args, ["--engine-core-cpus", args.core_cpus], client, client, "httpx"),
            "inprocess": lambda: run_server(args, ["--no-multiprocess"], core, client),
            "dp1": lambda: run_server(args, ["--engine-core-cpus", both], None, None),
            "dp2": lambda: run_server(args, ["--data-parallel-size", "2", "--engine-core-cpus", both], None, None),
        }
        repeats: list[dict[str, dict[str, Any]]] = []
        for _ in range(max(1, args.repeats)):
            runs: dict[str, dict[str, Any]] = {}
            for mode in args.modes.split(","):
                runs[mode] = plans[mode]()
                print(f"{mode}: {runs[mode]['output_throughput']:.1f} tok/s", file=sys.stderr, flush=True)
            repeats.append(runs)
    runs = _median_repeat(repeats)
    summary = _summary(runs)
    if len(repeats) > 1:
        summary["repeats"] = [{mode: r.get("ratio_to_offline", r["output_throughput"]) for mode, r in each.items()}
                              for each in repeats]
    warnings = dp_warnings(runs)
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary, "warnings": warnings}))
        return 0
    for mode, r in runs.items():
        print(_line(mode, r))
    print("summary: " + json.dumps(summary))
    for warning in warnings:
        print(warning)
    return 0


def dp_warnings(runs: dict[str, dict[str, Any]]) -> list[str]:
    """A warning when dp1 (one core with 2 threads) was slower than half of dp2 (two cores
    of one thread): on an oversubscribed host the 2-thread core collapses, and dp2 / dp1
    then measures OpenMP's spin-wait, not data parallelism."""
    if "dp1" not in runs or "dp2" not in runs:
        return []
    dp1, dp2 = runs["dp1"]["output_throughput"], runs["dp2"]["output_throughput"]
    if dp1 >= dp2 / 2:
        return []
    return [thread_collapse_warning(f"dp1 (one core on 2 CPUs, {dp1:.1f} tok/s) was slower than half of dp2 "
                                    f"({dp2:.1f})")]


def _median_repeat(repeats: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The repeat whose server / offline ratio is the median (the lower one of an even
    count), or the first when there is no such ratio. A shared machine's speed drifts
    between runs: a ratio is only fair between runs made side by side, so each repeat's
    ratios are its own and the median repeat is reported whole."""
    for runs in repeats:
        _ratios(runs)
    ranked = sorted(repeats, key=lambda runs: runs.get("mp", {}).get("ratio_to_offline", 0.0))
    return ranked[(len(ranked) - 1) // 2] if "mp" in repeats[0] and "offline" in repeats[0] else repeats[0]


def _ratios(runs: dict[str, dict[str, Any]]) -> None:
    """Each run's ratios to the offline run of its repeat (in place)."""
    offline = runs.get("offline", {})
    for mode, r in runs.items():
        if offline and mode != "offline":
            r["ratio_to_offline"] = r["output_throughput"] / offline["output_throughput"]
            r["ratio_per_core_cpu_s"] = r["tokens_per_core_cpu_s"] / offline["tokens_per_core_cpu_s"]


def _summary(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures in one place (``runs`` has its ratios from ``_ratios``):
    server / offline, the executor's bubbles under server load, TTFT / TPOT / ITL with the
    lean load generator ("after") and with httpx ("before"), and DP=2 against DP=1."""
    summary: dict[str, Any] = {}
    if "mp" in runs:
        mp = runs["mp"]
        summary["server_over_offline"] = mp.get("ratio_to_offline")
        summary["server_over_offline_per_engine_cpu_s"] = mp.get("ratio_per_core_cpu_s")
        summary["bubble_percent_under_server_load"] = 100 * mp["bubble_fraction"]
        summary["tokens_per_step"] = {m: runs[m]["tokens_per_step"] for m in ("offline", "mp", "mp-httpx")
                                      if m in runs}
    for label, mode in (("after", "mp"), ("before", "mp-httpx")):
        if mode in runs:
            summary[f"latency_ms_{label}"] = {k: runs[mode][f"{k}_ms"] for k in (
                "mean_ttft", "p99_ttft", "mean_tpot", "p99_tpot", "mean_itl", "p99_itl")}
    if "dp1" in runs and "dp2" in runs:
        summary["dp2_over_dp1"] = runs["dp2"]["output_throughput"] / runs["dp1"]["output_throughput"]
    return summary


def _line(mode: str, r: dict[str, Any]) -> str:
    line = f"{mode:<10} {r['output_throughput']:8.1f} tok/s"
    if "ratio_to_offline" in r:
        line += f"  ratio {r['ratio_to_offline']:.3f} (per engine CPU second {r['ratio_per_core_cpu_s']:.3f})"
    line += (f"  engine CPU share {r['core_cpu_share']:.2f}  bubbles {100 * r['bubble_fraction']:.2f}% of exec wall,"
             f" exec busy {r['exec_busy_fraction']:.2f}, {r['tokens_per_step']:.1f} tokens/step")
    if "mean_ttft_ms" in r:
        line += (f"  TTFT {r['mean_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms (engine {r['engine_mean_ttft_ms']:.0f})"
                 f"  TPOT {r['mean_tpot_ms']:.2f} ms  ITL {r['mean_itl_ms']:.2f}/{r['p99_itl_ms']:.2f} ms"
                 f"  CPU us/token: front end {r['front_end_cpu_us_per_token']:.0f}, client "
                 f"{r['client_cpu_us_per_token']:.0f}  failed {r['failed']}")
    return line


if __name__ == "__main__":
    sys.exit(main())
