"""Sliding-window attention: decode step time and KV blocks at context 512 / 2,048 / 8,192,
a windowed model against the same model with its window removed, and a hybrid model
against the same model with its window removed.

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

The hybrid model is Qwen2-shaped (the same sizes; qkv bias) with Gemma 2's pattern:
layers 0 and 2 windowed (512), 1 and 3 full (``layer_types``). With per-group block
tables (the runner asks the scheduler for them) each block holds 2 layers' KV, the full
layers' table keeps every block and the windowed layers' frees behind the window; the
same model with its window removed (``use_sliding_window`` false) keeps one table of
4-layer blocks. Blocks differ in size between the two, so the report gives
``hybrid_kv_mib`` / ``hybrid_full_kv_mib``: the pool's blocks in use times a block's bytes.

Bars (issue 23): windowed blocks in use flat beyond the window; windowed step time grows
< 1.3x from 2,048 to 8,192 (``windowed_growth_2048_to_8192``); the hybrid model's KV in
use tends to half the unwindowed one's as the context grows past the window
(``hybrid_kv_ratio_8192``).

Usage: python benches/sliding_window.py [--json] [--steps N] [--threads N] [--contexts 512,2048]
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
from bench_model import bench_config

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
    return bench_config("MistralForCausalLM", "mistral", max_position_embeddings=MAX_LEN, rope_theta=10000.0,
                        sliding_window=window, tie_word_embeddings=False)


def hybrid_config(window: int | None) -> dict:
    """Qwen2 with the bench's sizes and Gemma 2's pattern (windowed, full, windowed, full);
    ``window`` None: the window removed."""
    config = model_config(None)
    config.update({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": window is not None,
        "sliding_window": window if window is not None else WINDOW,
        "max_window_layers": 0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    })
    return config


def make_runner(folder: Path, config_json: dict, tables: int = 1) -> ModelRunner:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json))
    config = ExecutorConfig(
        dtype="float32",
        max_num_seqs=BATCH,
        max_model_len=MAX_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=BATCH * MAX_LEN // BLOCK_SIZE * tables,
        max_num_batched_tokens=PREFILL_CHUNK * BATCH,
        load_format="dummy",
        attention_backend="sdpa",
    )
    return ModelRunner.from_pretrained(folder, config)


class Decoder:
    """One model's runner and scheduler; ``fill(context)`` prefills a fresh batch to it."""

    def __init__(self, folder: Path, window: int | None, config_json: dict, tables: int = 1) -> None:
        self.window = window
        self.runner = make_runner(folder, config_json, tables)
        self.sched = Scheduler(SchedulerConfig(
            self.runner.num_kv_blocks, block_size=BLOCK_SIZE, max_num_seqs=BATCH, max_model_len=MAX_LEN,
            max_num_batched_tokens=PREFILL_CHUNK * BATCH, long_prefill_token_threshold=PREFILL_CHUNK,
            enable_prefix_caching=False, pipeline_depth=1, kv_groups=self.runner.kv_groups,
            group_tables=self.runner.group_tables,
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

    def kv_mib_in_use(self) -> float:
        """The pool's blocks in use times a block's bytes (blocks of per-group tables hold
        fewer layers)."""
        return round(self.blocks_in_use() * self.runner.kv_cache.shape.bytes_per_block / 2**20, 2)

    def blocks_read(self) -> int:
        """Blocks one layer's decode attention reads this step, over the batch."""
        length = self.context + self.decoded
        first = 0 if self.window is None else max(0, length - self.window)
        return BATCH * (-(-length // BLOCK_SIZE) - first // BLOCK_SIZE)


def run(steps: int, contexts: tuple[int, ...] = CONTEXTS) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        decoders = {
            "windowed": Decoder(Path(tmp) / "windowed", WINDOW, model_config(WINDOW)),
            "full": Decoder(Path(tmp) / "full", None, model_config(None)),
            "hybrid": Decoder(Path(tmp) / "hybrid", WINDOW, hybrid_config(WINDOW), tables=2),
            "hybrid_full": Decoder(Path(tmp) / "hybrid_full", None, hybrid_config(None)),
        }
        assert decoders["hybrid"].runner.num_kv_tables == 2, "the hybrid model should get per-group tables"
        windowed, full = decoders["windowed"], decoders["full"]
        hybrid, hybrid_full = decoders["hybrid"], decoders["hybrid_full"]
        results = []
        for context in contexts:
            for decoder in decoders.values():
                decoder.fill(context)
            times: dict[str, list[float]] = {name: [] for name in decoders}
            for index in range(steps + 3):  # the first 3 of each are warm-up
                for name, decoder in decoders.items():  # alternating: the same machine conditions
                    elapsed = decoder.step()
                    if index >= 3:
                        times[name].append(elapsed)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            windowed_ms, full_ms = ms["windowed"], ms["full"]
            results.append({
                "context": context,
                "windowed_step_ms": round(windowed_ms, 3),
                "full_step_ms": round(full_ms, 3),
                "full_over_windowed": round(full_ms / windowed_ms, 3),
                "windowed_blocks_in_use": windowed.blocks_in_use(),
                "full_blocks_in_use": full.blocks_in_use(),
                "windowed_blocks_read": windowed.blocks_read(),
                "full_blocks_read": full.blocks_read(),
                "hybrid_step_ms": round(ms["hybrid"], 3),
                "hybrid_full_step_ms": round(ms["hybrid_full"], 3),
                "hybrid_full_over_hybrid": round(ms["hybrid_full"] / ms["hybrid"], 3),
                "hybrid_blocks_in_use": hybrid.blocks_in_use(),
                "hybrid_full_blocks_in_use": hybrid_full.blocks_in_use(),
                "hybrid_kv_mib": hybrid.kv_mib_in_use(),
                "hybrid_full_kv_mib": hybrid_full.kv_mib_in_use(),
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
        "windowed_growth_2048_to_8192": _growth(by_context, "windowed_step_ms"),
        "full_growth_2048_to_8192": _growth(by_context, "full_step_ms"),
        "hybrid_growth_2048_to_8192": _growth(by_context, "hybrid_step_ms"),
        "hybrid_full_growth_2048_to_8192": _growth(by_context, "hybrid_full_step_ms"),
        "windowed_blocks_flat_beyond_window": len(
            {r["windowed_blocks_in_use"] for r in results if r["context"] > WINDOW}
        ) == 1,
        "hybrid_kv_ratio_8192": round(by_context[8192]["hybrid_kv_mib"] / by_context[8192]["hybrid_full_kv_mib"], 3)
        if 8192 in by_context else None,
        "note": "blocks_in_use is the scheduler's pool: windowed, the blocks behind the window are freed; "
                "hybrid: its windowed layers' table frees them, its blocks hold 2 of the 4 layers",
    }


def _growth(by_context: dict[int, dict], key: str):
    if 2048 not in by_context or 8192 not in by_context:
        return None
    return round(by_context[8192][key] / by_context[2048][key], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per context")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="contexts, comma-separated")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.steps, tuple(int(c) for c in args.contexts.split(",")))
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
        print(
            f"  hybrid {r['hybrid_step_ms']:8.2f} ms, window removed {r['hybrid_full_step_ms']:8.2f} ms "
            f"({r['hybrid_full_over_hybrid']:.2f}x); blocks in use {r['hybrid_blocks_in_use']} / "
            f"{r['hybrid_full_blocks_in_use']}, KV in use {r['hybrid_kv_mib']} / {r['hybrid_full_kv_mib']} MiB"
        )
    print(f"windowed growth 2048 -> 8192: {report['windowed_growth_2048_to_8192']}x "
          f"(full: {report['full_growth_2048_to_8192']}x); hybrid {report['hybrid_growth_2048_to_8192']}x "
          f"(window removed: {report['hybrid_full_growth_2048_to_8192']}x); hybrid KV at 8192: "
          f"{report['hybrid_kv_ratio_8192']} of the window removed's")
    print(report["note"])


if __name__ == "__main__":
    main()
