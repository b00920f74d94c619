"""Per-step cost of the logits processors at batch 256, next to the sampler's own time.

One executor step's processor work is ``LogitsPipeline.process`` (lay the batch out,
``update_state``, ``apply`` on the ``[256, vocab]`` logits) plus ``record_sampled``.
Measured, as the median over repeated steps on the same logits:

- ``no processor``: an empty pipeline (the layout tracking and output lists alone);
- ``built-ins idle``: the four built-in processors, no request using their fields;
- ``+ no-op custom``: the same plus a custom processor whose ``apply`` returns the logits;
- ``min_tokens`` / ``logit_bias`` / ``allowed_token_ids`` / ``bad_words``: the built-ins
  with every row using that field;
- ``churn (no-op)``: a no-op custom processor while one request leaves and one joins
  every step (a ``BatchUpdate`` with removals, an addition and moves);
- ``front churn: <field>``: every row using that field while the batch's first request
  leaves and one joins at the end every step (every other request's index shifts by one:
  the worst layout change); ``allowed_token_ids 32 x 20k`` has 32 restricted rows of
  20,000 allowed ids each among the 256;

and, for scale, ``Sampler.sample`` at temperature 0.8 and greedy on the same logits.

    python benches/logits_processors.py [--json] [--repeats 50] [--vocab 151936] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Optional

import numpy as np
import torch

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.logits_pipeline import LogitsPipeline
from pyengine.executor.sampler import Sampler
from pyengine.executor.sampling_table import SamplingTable
from pyengine.logits_processors import BatchUpdate, LogitsProcessor
from pyengine.sampling_params import SamplingParams

BATCH = 256


class NoOpLogitsProcessor(LogitsProcessor):
    def __init__(self, config, device, is_pin_memory) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False  # never skipped

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _median_ms(step: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _field_params(kind: str, row: int, vocab: int, rng: np.random.Generator, allowed_ids: int = 100,
                  restricted: int = BATCH) -> SamplingParams:
    if row % BATCH >= restricted:
        return SamplingParams()
    if kind == "min_tokens":
        return SamplingParams(min_tokens=10**6, max_tokens=None, stop_token_ids=[1, 2, 3])
    if kind == "logit_bias":
        return SamplingParams(logit_bias={int(t): 5.0 for t in rng.choice(vocab, 10, replace=False)})
    if kind == "allowed_token_ids":
        return SamplingParams(allowed_token_ids=rng.choice(vocab, allowed_ids, replace=False).tolist())
    if kind == "bad_words":
        words = [rng.choice(vocab, int(n)).tolist() for n in (1, 2, 2, 3, 3)]
        return SamplingParams(_bad_words_token_ids=words)
    return SamplingParams()


def measure_pipeline(name: str, kind: str, custom: list, vocab: int, device: torch.device, repeats: int,
                     churn: str = "", allowed_ids: int = 100, restricted: int = BATCH) -> dict:
    """``churn``: "" (steady), "middle" or "front" (where the request that leaves each
    step sits); the joining request uses the same field."""
    config = ExecutorConfig(max_num_seqs=BATCH * 2, device=str(device))
    if name == "no processor":
        pipeline = LogitsPipeline([], config.max_num_seqs)
    else:
        pipeline = LogitsPipeline.build(config, device, eos_token_ids=(0,), custom=custom)
    rng = np.random.default_rng(0)
    # Requests (by persistent row) are made once, so a joining request costs its install only.
    fields = [_field_params(kind, row, vocab, rng, allowed_ids, restricted) for row in range(BATCH * 2)]
    for row in range(BATCH):
        pipeline.install(row, fields[row], [5, 6, 7], [])
    logits = torch.randn(BATCH, vocab, device=device)
    tokens = torch.randint(0, vocab, (BATCH,), device=device)
    host_tokens = tokens.cpu().numpy()
    state = {"rows": np.arange(BATCH, dtype=np.int32), "next": BATCH}

    def step() -> None:
        rows = state["rows"]
        if churn:  # one request leaves, a new one joins at the end
            at = BATCH // 2 if churn == "middle" else 0
            gone = int(rows[at])
            pipeline.free(np.array([gone]))
            new_row = state["next"] % (BATCH * 2)
            state["next"] += 1
            pipeline.install(new_row, fields[new_row], [5, 6, 7], [])
            rows = np.concatenate([rows[:at], rows[at + 1:], [new_row]]).astype(np.int32)
            state["rows"] = rows
        pipeline.process(logits, rows, greedy_only=False)
        pipeline.record_sampled(tokens, host_tokens)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return {"name": name, "ms": round(_median_ms(step, repeats, sync), 4)}


def measure_sampler(name: str, params: SamplingParams, vocab: int, device: torch.device, repeats: int) -> dict:
    table, rows = SamplingTable(BATCH, device), np.arange(BATCH)
    table.install(rows, [params] * BATCH)
    sampler = Sampler(table, torch.Generator(device=device).manual_seed(0))
    logits = torch.randn(BATCH, vocab, device=device)
    positions = torch.zeros(BATCH, dtype=torch.int64, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return {"name": name, "ms": round(_median_ms(lambda: sampler.sample(logits, rows, positions, None), repeats, sync), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device, vocab, repeats = torch.device(args.device), args.vocab, args.repeats
    results = [
        measure_pipeline("no processor", "", [], vocab, device, repeats),
        measure_pipeline("built-ins idle", "", [], vocab, device, repeats),
        measure_pipeline("+ no-op custom", "", [NoOpLogitsProcessor], vocab, device, repeats),
        *(measure_pipeline(kind, kind, [], vocab, device, repeats)
          for kind in ("min_tokens", "logit_bias", "allowed_token_ids", "bad_words")),
        measure_pipeline("churn (no-op)", "", [NoOpLogitsProcessor], vocab, device, repeats, churn="middle"),
        *(measure_pipeline(f"front churn: {kind}", kind, [], vocab, device, repeats, churn="front")
          for kind in ("min_tokens", "logit_bias", "allowed_token_ids", "bad_words")),
        measure_pipeline("front churn: allowed_token_ids 32 x 20k", "allowed_token_ids", [], vocab, device,
                         repeats, churn="front", allowed_ids=20_000, restricted=32),
        measure_pipeline("front churn: no-op custom", "", [NoOpLogitsProcessor], vocab, device, repeats,
                         churn="front"),
        measure_sampler("sampler, temperature 0.8", SamplingParams(temperature=0.8), vocab, device, repeats),
        measure_sampler("sampler, greedy", SamplingParams(temperature=0.0), vocab, device, repeats),
    ]
    header = {"device": str(device), "vocab": vocab, "batch": BATCH, "torch_threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps({**header, "results": results}))
        return
    print(f"batch {BATCH}, vocab {vocab}, {device}, {header['torch_threads']} torch threads (median per step)")
    base = results[0]["ms"]
    for r in results:
        print(f"  {r['name']:<42} {r['ms'] * 1e3:10.1f} us   ({r['ms'] - base:+.4f} ms vs no processor)")


if __name__ == "__main__":
    main()
