"""Online serving benchmark, like vLLM's ``benchmark_serving``: requests sent to an
OpenAI-compatible ``/v1/completions`` endpoint at a given rate (Poisson arrivals) or
concurrency, streamed, and timed from the client side.

Reported: request throughput, output (and total) tokens/s, and mean / p50 / p99 of
TTFT (time to first token), TPOT (time per output token after the first, per request),
ITL (gap between successive streamed chunks) and end-to-end latency.

Prompts are random token ids (``--input-len`` tokens, or uniformly within
``--range-ratio`` of it), each asking for ``--output-len`` tokens with ``ignore_eos``.

    python benches/serve.py --url http://127.0.0.1:8000 [--num-prompts 200] [--request-rate 20]
    python benches/serve.py --spawn [--json]     # starts `pyengine serve` (tiny model) itself

Only loopback servers are expected; every request has a timeout and the run is bounded
by ``--num-prompts``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

from pyengine.testing.serve_process import ServeProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_client import ConnectionPool, HTTPStatusError  # noqa: E402 - this folder's module


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _body(model: Optional[str], prompt: list[int], output_len: int) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True}  # a chunk with tokens but no text yet still counts
    if model:
        body["model"] = model
    return body


class _Timer:
    """A request's client-side times, fed with each streamed chunk."""

    def __init__(self, result: Result, start: float) -> None:
        self.result = result
        self.start = start
        self.last: Optional[float] = None

    def chunk(self, chunk: dict[str, Any]) -> bool:
        """Takes one chunk; False when it is an error (recorded)."""
        if "error" in chunk:
            self.result.error = chunk["error"]["message"]
            return False
        now = time.perf_counter()
        if chunk.get("usage"):
            self.result.output_tokens = chunk["usage"]["completion_tokens"]
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        if choice.get("token_ids") or choice.get("text"):
            if self.last is None:
                self.result.ttft = now - self.start
            else:
                self.result.itl.append(now - self.last)
            self.last = now
        return True

    def done(self) -> Result:
        self.result.e2e = time.perf_counter() - self.start
        self.result.ok = self.result.output_tokens > 0
        return self.result


async def one_request(pool: ConnectionPool, url: str, model: Optional[str], prompt: list[int],
                      output_len: int, timeout: float) -> Result:
    """One streamed completion over a connection of ``pool`` (the lean client)."""
    body = json.dumps(_body(model, prompt, output_len)).encode()
    timer = _Timer(Result(ok=False, prompt_tokens=len(prompt)), time.perf_counter())
    connection = pool.take()
    clean = False

    async def consume() -> bool:
        async for data in connection.stream_events("/v1/completions", body):
            if data != b"[DONE]" and not timer.chunk(json.loads(data)):
                return False
        return True

    try:
        if not await asyncio.wait_for(consume(), timeout):
            return timer.result
        clean = True
        return timer.done()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError,
            HTTPStatusError) as error:
        timer.result.error = str(error) if isinstance(error, HTTPStatusError) else repr(error)
        return timer.result
    finally:
        if clean:
            pool.give_back(connection)
        else:
            connection.close()


async def one_request_httpx(http: httpx.AsyncClient, url: str, model: Optional[str], prompt: list[int],
                            output_len: int, timeout: float) -> Result:
    """The same through httpx (``--client httpx``: the load generator before the lean one)."""
    timer = _Timer(Result(ok=False, prompt_tokens=len(prompt)), time.perf_counter())
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=_body(model, prompt, output_len),
                               timeout=timeout) as resp:
            if resp.status_code != 200:
                timer.result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return timer.result
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and not timer.chunk(json.loads(line[6:])):
                    return timer.result
        return timer.done()
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        timer.result.error = repr(error)
    return timer.result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _summary(name: str, values: list[float]) -> dict[str, float]:
    ms = [1e3 * v for v in values]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
            f"p50_{name}_ms": _pct(ms, 50), f"p99_{name}_ms": _pct(ms, 99)}


@asynccontextmanager
async def _client(args: argparse.Namespace, url: str) -> AsyncIterator[Callable[[list[int], int], Awaitable[Result]]]:
    """``send(prompt, output_len)`` through the chosen client (``args.client``)."""
    if getattr(args, "client", "lean") == "httpx":
        # Idle connections expire before the server (uvicorn: 5 s) closes them: no reuse races.
        limits = httpx.Limits(max_connections=args.max_concurrency or 1000, max_keepalive_connections=256,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as http:
            yield lambda prompt, n: one_request_httpx(http, url, args.model, prompt, n, args.timeout)
        return
    pool = ConnectionPool(url)
    try:
        yield lambda prompt, n: one_request(pool, url, args.model, prompt, n, args.timeout)
    finally:
        pool.close()


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    low = max(1, int(args.input_len * (1 - args.range_ratio)))
    high = max(low, int(args.input_len * (1 + args.range_ratio)))
    prompts = [[rng.randrange(args.min_token_id, args.vocab) for _ in range(rng.randint(low, high))]
               for _ in range(args.num_prompts)]
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with _client(args, url) as send:
        for _ in range(args.warmup):
            await send(prompts[0], 4)

        async def limited(prompt: list[int]) -> Result:
            if gate is None:
                return await send(prompt, args.output_len)
            async with gate:
                return await send(prompt, args.output_len)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results: list[Result] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    report: dict[str, Any] = {
        "url": url, "num_prompts": args.num_prompts,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,  # None: all at once
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "completed": len(done), "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
    }
    report.update(_summary("ttft", [r.ttft for r in done]))
    report.update(_summary("tpot", tpot))
    report.update(_summary("itl", [g for r in done for g in r.itl]))
    report.update(_summary("e2e", [r.e2e for r in done]))
    errors = [r.error for r in results if not r.ok]
    if errors:
        report["first_error"] = errors[0]
    return report


@contextmanager
def spawned_server(extra: list[str], timeout: float = 120.0) -> Iterator[str]:
    """``pyengine serve`` (the built-in tiny model unless ``extra`` names one) on a free
    loopback port; stopped with Ctrl-C at the end."""
    with ServeProcess(["--no-log-requests", "--stats-interval", "0", "--log-level", "warning", *extra]) as server:
        yield server.wait_up(timeout).url


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"{'Successful requests:':<34}{r['completed']} ({r['failed']} failed)",
        f"{'Benchmark duration (s):':<34}{r['duration_s']:.2f}",
        f"{'Request throughput (req/s):':<34}{r['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<34}{r['output_throughput']:.1f}",
        f"{'Total token throughput (tok/s):':<34}{r['total_token_throughput']:.1f}",
    ]
    for name, title in (("ttft", "Time to first token"), ("tpot", "Time per output token"),
                        ("itl", "Inter-token latency"), ("e2e", "End-to-end latency")):
        lines.append(f"{title + ' (ms):':<34}mean {r[f'mean_{name}_ms']:.2f}, p50 {r[f'p50_{name}_ms']:.2f}, "
                     f"p99 {r[f'p99_{name}_ms']:.2f}")
    if "first_error" in r:
        lines.append(f"first error: {r['first_error']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--spawn", action="store_true", help="start `pyengine serve` (tiny model) for the run")
    parser.add_argument("--serve-args", default="--max-num-seqs 256",
                        help="extra `pyengine serve` arguments with --spawn (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: none, the server's)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most (0: no cap)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="prompt lengths within +- this fraction")
    parser.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn below this")
    parser.add_argument("--min-token-id", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", choices=("lean", "httpx"), default="lean",
                        help="the load generator's HTTP client (default: %(default)s; sse_client.py says why)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if args.spawn:
        with spawned_server(args.serve_args.split()) as url:
            report = asyncio.run(run(args, url))
    else:
        report = asyncio.run(run(args, args.url.rstrip("/")))
    print(json.dumps(report, allow_nan=False) if args.json else format_report(report))
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
