"""Soak benchmark: memory over time. Sends ``--num-requests`` requests (default 10,000)
to ``pyengine serve`` and reports the server's resident memory (VmRSS, from
``/proc/PID/status``) after the warm-up, at 1,000 requests and at the end, and the growth
between 1,000 and the end. The bar (issue 11): at most 50 MB from 1k to 10k.

``pyengine serve`` runs its engine cores in child processes (``--no-multiprocess`` runs
one process), so the HTTP front end and each engine core (with its tensor-parallel
workers, if any) are measured separately, and the bar is checked on their sum. A mark the
run did not reach (``--max-seconds`` stopped it first) is reported as null and its
growth is not checked.

Prompts and outputs vary in length (prompt lengths spread over two orders of magnitude,
1-12 output tokens, ``--concurrency`` requests in flight), so the steps' token counts
vary as they do under real traffic; outputs are short so 10,000 requests take minutes
on two cores.

    python benches/soak.py                    # spawns `pyengine serve` (tiny model) on loopback
    python benches/soak.py --num-requests 3000 --json
    python benches/soak.py --url http://127.0.0.1:8000 --pid 1234   # a running local server

The run is bounded: ``--max-seconds`` for the whole soak, ``--timeout`` per request;
loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx

from pyengine.testing.serve_process import ServeProcess
from pyengine.testing.waits import child_pids

#: The issue's bar: RSS may grow at most this much between 1k requests and the end.
GROWTH_BAR_MB = 50.0


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def engine_core_pids(front_end: int) -> list[int]:
    """The front end's engine-core processes (``pyengine core ... --engine-index N``), not
    any other child it may have for a moment (a compiler probe during imports)."""
    cores = []
    for pid in child_pids(front_end):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"--engine-index" in cmdline:
            cores.append(pid)
    return cores


def tree_rss_mb(pid: int) -> float:
    """RSS of ``pid`` and all its descendants (a core and its tensor-parallel workers), MiB."""
    return rss_mb(pid) + sum(tree_rss_mb(child) for child in child_pids(pid))


class ServerMemory:
    """The server's processes: the front end and its engine cores, found once (the
    server is up). ``sample`` is each one's RSS in MiB and their ``total``."""

    def __init__(self, front_end: int) -> None:
        self.front_end = front_end
        self.cores = engine_core_pids(front_end)

    def names(self) -> list[str]:
        return ["front_end", *(f"core_{i}" for i in range(len(self.cores))), "total"]

    def sample(self) -> dict[str, float]:
        figures = {"front_end": round(rss_mb(self.front_end), 1)}
        for i, pid in enumerate(self.cores):
            figures[f"core_{i}"] = round(tree_rss_mb(pid), 1)
        figures["total"] = round(sum(figures.values()), 1)
        return figures


def growth(at_1k: Optional[dict[str, float]], end: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
    """Each process's growth from the 1k mark to the end; None when a mark was not reached."""
    if at_1k is None or end is None:
        return None
    return {name: round(end[name] - at_1k[name], 1) for name in end}


@contextmanager
def spawned_server(extra: list[str], timeout: float = 180.0) -> Iterator[tuple[str, int]]:
    """``pyengine serve`` on a free loopback port: yields (url, pid); Ctrl-C at the end."""
    with ServeProcess(["--no-log-requests", "--stats-interval", "0", "--log-level", "warning", *extra]) as server:
        yield server.wait_up(timeout).url, server.pid


def _request(rng: random.Random, args: argparse.Namespace) -> tuple[list[int], int]:
    # Log-uniform prompt lengths: as many short prompts as long ones, so decode-heavy and
    # prefill-heavy steps (and every token count between) keep turning up.
    length = int(round(2 ** rng.uniform(0, args.max_prompt_len.bit_length() - 1)))
    length = max(1, min(args.max_prompt_len, length))
    prompt = [rng.randrange(args.min_token_id, args.vocab) for _ in range(length)]
    return prompt, rng.randint(1, args.max_output_len)


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    warmup = min(args.warmup, args.num_requests)
    marks = sorted({warmup, min(1000, args.num_requests), args.num_requests})
    memory = ServerMemory(pid)
    rss: dict[int, dict[str, float]] = {}
    trail: list[tuple[int, float]] = []
    done = failed = 0
    first_error = ""
    deadline = time.monotonic() + args.max_seconds
    next_id = 0
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency,
                          keepalive_expiry=2.0)
    start = time.perf_counter()
    rss_start = memory.sample()

    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as http:
        async def worker() -> None:
            nonlocal done, failed, first_error, next_id
            while next_id < args.num_requests and time.monotonic() < deadline:
                next_id += 1
                prompt, max_tokens = _request(rng, args)
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
                try:
                    resp = await http.post(f"{url}/v1/completions", json=body)
                    if resp.status_code != 200:
                        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                except Exception as error:  # noqa: BLE001 - counted and reported
                    failed += 1
                    first_error = first_error or repr(error)
                done += 1
                if done in marks:
                    rss[done] = memory.sample()
                if done % args.trail_every == 0:
                    trail.append((done, memory.sample()["total"]))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    duration = time.perf_counter() - start
    report: dict[str, Any] = {
        "num_requests": args.num_requests, "completed": done - failed, "failed": failed,
        "timed_out": done < args.num_requests, "duration_s": round(duration, 1),
        "request_throughput": round(done / duration, 1), "concurrency": args.concurrency,
        "processes": {"front_end": pid, **{f"core_{i}": core for i, core in enumerate(memory.cores)}},
        "rss_start_mb": rss_start,
        "rss_after_warmup_mb": rss.get(warmup), "warmup_requests": warmup,
        "rss_at_1k_mb": rss.get(min(1000, args.num_requests)),
        "rss_end_mb": rss.get(args.num_requests, memory.sample()),
        "rss_trail_mb": trail,
    }
    # Growth from the 1k mark to the end: null when the run stopped before the 1k mark.
    report["growth_1k_to_end_mb"] = growth(report["rss_at_1k_mb"], report["rss_end_mb"])
    if first_error:
        report["first_error"] = first_error
    return report


def _cell(figures: Optional[dict[str, float]], name: str) -> str:
    return "-" if figures is None else f"{figures[name]:.1f}"


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"{'Requests:':<30}{r['completed']} ok, {r['failed']} failed"
        + (" (stopped at --max-seconds)" if r["timed_out"] else ""),
        f"{'Duration (s):':<30}{r['duration_s']} ({r['request_throughput']} req/s, "
        f"concurrency {r['concurrency']})",
        f"RSS (MB; warm-up = {r['warmup_requests']} requests, end = {r['num_requests']}; "
        "- = mark not reached):",
        f"  {'process':<12}{'pid':>8}{'start':>10}{'warm-up':>10}{'1k':>10}{'end':>10}{'1k->end':>10}",
    ]
    columns = ("rss_start_mb", "rss_after_warmup_mb", "rss_at_1k_mb", "rss_end_mb", "growth_1k_to_end_mb")
    for name in r["rss_start_mb"]:
        pid = r["processes"].get(name, "")
        lines.append(f"  {name:<12}{pid:>8}" + "".join(f"{_cell(r[column], name):>10}" for column in columns))
    lines.append("RSS trail, all processes (requests, MB): "
                 + ", ".join(f"{n}: {m}" for n, m in r["rss_trail_mb"]))
    if "first_error" in r:
        lines.append(f"first error: {r['first_error']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running loopback server (needs --pid); default: spawn one")
    parser.add_argument("--pid", type=int, help="the running server's (front end's) process id; its engine cores are found as its children")
    parser.add_argument("--serve-args", default="", help="extra `pyengine serve` arguments when spawning")
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=200, help="requests before the first RSS figure")
    parser.add_argument("--concurrency", type=int, default=48, help="requests in flight")
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn below this")
    parser.add_argument("--min-token-id", type=int, default=10)
    parser.add_argument("--trail-every", type=int, default=1000, help="an RSS sample every so many requests")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="the whole soak at most (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if args.url:
        if args.pid is None:
            parser.error("--url needs --pid (the server's front-end process, for the RSS figures)")
        report = asyncio.run(soak(args, args.url.rstrip("/"), args.pid))
    else:
        with spawned_server(args.serve_args.split()) as (url, pid):
            report = asyncio.run(soak(args, url, pid))
    print(json.dumps(report, allow_nan=False) if args.json else format_report(report))
    within_bar = check_bar(report)
    return 0 if report["failed"] == 0 and not report["timed_out"] and within_bar else 1


def check_bar(report: dict[str, Any]) -> bool:
    """The bar on the processes' summed growth from 1k requests to the end; says on stderr
    why it failed, or that it could not be checked (the run stopped before the 1k mark)."""
    grown = report["growth_1k_to_end_mb"]
    if grown is None:
        print(f"RSS growth not checked: the run stopped after {report['completed'] + report['failed']} requests, "
              "before the 1k mark", file=sys.stderr)
        return True
    if grown["total"] > GROWTH_BAR_MB:
        print(f"RSS grew {grown['total']} MB after 1k requests (all processes): the bar is {GROWTH_BAR_MB} MB",
              file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
