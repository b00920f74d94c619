"""Sliding-window attention: decode step time and KV blocks at context 512 / 2,048 / 8,192,
a windowed model against the same model with its window removed.

Model: Mistral-shaped, dummy weights (bench_model's sizes: hidden 256, 4 layers, 4 heads /
2 KV heads of 64, vocab 4096, float32), ``sliding_window`` 512 on every layer vs none.
For each context, 4 sequences are prefilled to it through the ``ModelRunner`` (chunks of
2,048), then decode steps are timed, the two models' steps alternating so both see the
same machine conditions. Reported per context: the median step time of each, their
ratio, and

- ``blocks_in_use``: KV blocks the sequences hold. The scheduler still keeps every block
  of a sequence: freeing the blocks that fall behind the window is the scheduler's KV
  groups, not done yet, so this grows with the context for both models.
- ``blocks_read``: blocks one layer's decode attention reads per step (windowed: at most
  ``ceil(window / block) + 1`` per sequence).

Bar (issue 23): windowed step time grows < 1.3x from 2,048 to 8,192 (``growth_2048_to_8192``).

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

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.hand_plan import HandPlanner

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
    """One model's runner and planner; ``fill(context)`` prefills a fresh batch to it."""

    def __init__(self, folder: Path, window: int | None) -> None:
        self.window = window
        self.runner = make_runner(folder, window)
        self.planner = HandPlanner(
            block_size=BLOCK_SIZE, num_blocks=self.runner.num_kv_blocks, max_rows=BATCH, scatter_blocks=True, seed=1
        )
        self.seq_ids: list[int] = []

    def fill(self, context: int) -> None:
        for seq_id in self.seq_ids:
            self.planner.finish(seq_id)
        rng = np.random.default_rng(context)
        self.seq_ids = [
            self.planner.add(rng.integers(0, 4096, size=context - 1).tolist(), SamplingParams(temperature=0.0))
            for _ in range(BATCH)
        ]
        while any(len(self.planner.output_tokens(s)) == 0 for s in self.seq_ids):
            self._run(max_chunk=PREFILL_CHUNK)

    def _run(self, max_chunk: int | None = None) -> float:
        plan = self.planner.next_plan(max_chunk=max_chunk)  # planning is the scheduler's: not timed
        start = time.perf_counter()
        out = self.runner.execute(plan)
        elapsed = time.perf_counter() - start
        self.planner.record(plan, out.sampled_token_ids)
        return elapsed

    def step(self) -> float:
        return self._run()

    def blocks_in_use(self) -> int:
        return sum(-(-len(self.planner.tokens(s)) // BLOCK_SIZE) for s in self.seq_ids)

    def blocks_read(self) -> int:
        """Blocks one layer's decode attention reads this step, over the batch."""
        total = 0
        for seq_id in self.seq_ids:
            length = len(self.planner.tokens(seq_id))
            first = 0 if self.window is None else max(0, length - self.window)
            total += -(-length // BLOCK_SIZE) - first // BLOCK_SIZE
        return total


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
        "note": "blocks_in_use grows for both: the scheduler does not free blocks behind the window yet",
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
