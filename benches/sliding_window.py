"""Sliding-window attention: decode step time and KV blocks at context 512 / 2,048 / 8,192,
a windowed model against the same model with its window removed.

Model: Mistral-shaped, dummy weights (bench_model's sizes: hidden 256, 4 layers, 4 heads /
2 KV heads of 64, vocab 4096, float32), ``sliding_window`` 512 on every layer vs none.
For each context, 4 sequences are prefilled to it (chunks of 2,048) and decoded, planned
by the real scheduler (``pyengine._sched.Scheduler``, depth 1, prefix caching off, the
runner's KV groups in its config) and run by the ``ModelRunner``; decode steps are timed
(the runner only: planning is measured by ``sched_step.py``), the two models' steps
alternating so both see the same machine conditions. Reported per context: the median
step time of each, their ratio, and

- ``blocks_in_use``: KV blocks the scheduler's pool has in use while the 4 sequences
  decode at that context (its stats' ``kv_blocks_used``). Every layer windowed, the
  scheduler frees the blocks behind the window, so this stays flat beyond it; the model
  without a window holds every block.
- ``blocks_read``: blocks one layer's decode attention reads per step (windowed: at most
  ``ceil(window / block) + 1`` per sequence).

Bars (issue 23): windowed blocks in use flat beyond the window; windowed step time grows
< 1.3x from 2,048 to 8,192 (``windowed_growth_2048_to_8192``).

Usage: python benches/sliding_window.py [--json] [--steps N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pyengine._sched import Request, Scheduler, SchedulerConfig
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams

WINDOW = 512
CONTEXTS = (512, 2048, 8192)
BATCH = 4
BLOCK_SIZE = 16
PREFILL_CHUNK = 2048
MAX_LEN = 8192 + 256


def model_config(window: int | None) -> dict:
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAX_LEN,
        "rope_theta": 10000.0,
        "sliding_window": window,
        "tie_word_embeddings": False,
    }


def make_runner(folder: Path, window: int | None) -> ModelRunner:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_config(window)))
    config = ExecutorConfig(
        dtype="float32",
        max_num_seqs=BATCH,
        max_model_len=MAX_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=BATCH * MAX_LEN // BLOCK_SIZE,
        max_num_batched_tokens=PREFILL_CHUNK * BATCH,
        load_format="dummy",
        attention_backend="sdpa",
    )
    return ModelRunner.from_pretrained(folder, config)


class Decoder:
    """One model's runner and scheduler; ``fill(context)`` prefills a fresh batch to it."""

    def __init__(self, folder: Path, window: int | None) -> None:
        self.window = window
        self.runner = make_runner(folder, window)
        self.sched = Scheduler(SchedulerConfig(
            self.runner.num_kv_blocks, block_size=BLOCK_SIZE, max_num_seqs=BATCH, max_model_len=MAX_LEN,
            max_num_batched_tokens=PREFILL_CHUNK * BATCH, long_prefill_token_threshold=PREFILL_CHUNK,
            enable_prefix_caching=False, pipeline_depth=1, kv_groups=self.runner.kv_groups,
        ))
        self.request_ids: list[str] = []
        self.context = 0
        self.decoded = 0

    def fill(self, context: int) -> None:
        for request_id in self.request_ids:
            self.sched.abort(request_id)
        self.sched.take_output()
        rng = np.random.default_rng(context)
        self.request_ids = [f"{context}-{i}" for i in range(BATCH)]
        for request_id in self.request_ids:
            prompt = rng.integers(0, 4096, size=context - 1).tolist()
            self.sched.add_request(Request(request_id, prompt, max_tokens=MAX_LEN - context, ignore_eos=True,
                                           sample_params=[SamplingParams(temperature=0.0)]))
        self.context, self.decoded = context, 0
        while self._run()[1] < BATCH:  # until every prompt is in and sampled once
            pass

    def _run(self) -> tuple[float, int]:
        """One planned step, run and applied: its runner time and how many rows sampled."""
        plan = self.sched.schedule()  # planning is the scheduler's: not timed
        assert plan is not None, "nothing to plan"
        start = time.perf_counter()
        out = self.runner.execute(plan)
        elapsed = time.perf_counter() - start
        self.sched.apply_result(plan.step_id, out.sampled_token_ids)
        self.sched.take_output(plan.step_id)
        return elapsed, len(plan.logits_indices)

    def step(self) -> float:
        self.decoded += 1
        return self._run()[0]

    def blocks_in_use(self) -> int:
        return int(self.sched.stats()["kv_blocks_used"])

    def blocks_read(self) -> int:
        """Blocks one layer's decode attention reads this step, over the batch."""
        length = self.context + self.decoded
        first = 0 if self.window is None else max(0, length - self.window)
        return BATCH * (-(-length // BLOCK_SIZE) - first // BLOCK_SIZE)


def run(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        windowed, full = Decoder(Path(tmp) / "windowed", WINDOW), Decoder(Path(tmp) / "full", None)
        results = []
        for context in CONTEXTS:
            windowed.fill(context)
            full.fill(context)
            times: dict[str, list[float]] = {"windowed": [], "full": []}
            for index in range(steps + 3):  # the first 3 of each are warm-up
                w, f = windowed.step(), full.step()
                if index >= 3:
                    times["windowed"].append(w)
                    times["full"].append(f)
            windowed_ms = statistics.median(times["windowed"]) * 1e3
            full_ms = statistics.median(times["full"]) * 1e3
            results.append({
                "context": context,
                "windowed_step_ms": round(windowed_ms, 3),
                "full_step_ms": round(full_ms, 3),
                "full_over_windowed": round(full_ms / windowed_ms, 3),
                "windowed_blocks_in_use": windowed.blocks_in_use(),
                "full_blocks_in_use": full.blocks_in_use(),
                "windowed_blocks_read": windowed.blocks_read(),
                "full_blocks_read": full.blocks_read(),
            })
    by_context = {r["context"]: r for r in results}
    return {
        "bench": "sliding_window",
        "window": WINDOW,
        "batch": BATCH,
        "block_size": BLOCK_SIZE,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "results": results,
        "windowed_growth_2048_to_8192": round(
            by_context[8192]["windowed_step_ms"] / by_context[2048]["windowed_step_ms"], 3
        ),
        "full_growth_2048_to_8192": round(by_context[8192]["full_step_ms"] / by_context[2048]["full_step_ms"], 3),
        "windowed_blocks_flat_beyond_window": len(
            {r["windowed_blocks_in_use"] for r in results if r["context"] > WINDOW}
        ) == 1,
        "note": "blocks_in_use is the scheduler's pool: windowed, the blocks behind the window are freed",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per context")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.steps)
    if args.json:
        print(json.dumps(report))
        return
    print(f"window {WINDOW}, batch {BATCH}, {report['threads']} threads, median of {args.steps} steps")
    for r in report["results"]:
        print(
            f"context {r['context']:>5}: windowed {r['windowed_step_ms']:8.2f} ms, full {r['full_step_ms']:8.2f} ms "
            f"({r['full_over_windowed']:.2f}x); blocks in use {r['windowed_blocks_in_use']} / "
            f"{r['full_blocks_in_use']}, read per layer {r['windowed_blocks_read']} / {r['full_blocks_read']}"
        )
    print(f"windowed growth 2048 -> 8192: {report['windowed_growth_2048_to_8192']}x "
          f"(full: {report['full_growth_2048_to_8192']}x)")
    print(report["note"])


if __name__ == "__main__":
    main()
