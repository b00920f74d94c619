"""Executor step time on CPU: paged ModelRunner vs a plain contiguous-KV forward.

Model: Qwen3-shaped, random weights (hidden 256, 4 layers, 4 heads / 2 KV heads,
head_dim 64, vocab 4096, float32). Measured in one run:

- decode: one step for 64 requests with 384 tokens of context. "paged" is the whole
  ``ModelRunner.execute`` (plan arrays -> tensors, paged attention over scattered blocks,
  greedy sampling, bookkeeping); "contiguous" is the model forward over a dense
  per-sequence KV cache plus argmax, the lower bound. Bar: paged <= 1.3x contiguous.
- prefill: 8 prompts of 512 tokens in one step, tokens per second (paged and contiguous).

Usage: python benches/executor_step.py [--json] [--steps N] [--threads N]
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

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.contiguous_reference import ContiguousKVCache, contiguous_step
from pyengine.testing.hand_plan import HandPlanner

MODEL_CONFIG = bench_config("Qwen3ForCausalLM", "qwen3", max_position_embeddings=2048,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
DECODE_BATCH, DECODE_CONTEXT = 64, 384
PREFILL_PROMPTS, PREFILL_LENGTH = 8, 512
BLOCK_SIZE = 16


def make_runner(folder: Path, max_num_seqs: int) -> ModelRunner:
    config = ExecutorConfig(
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_num_seqs * 1024 // BLOCK_SIZE,
        load_format="dummy",
        attention_backend="sdpa",
    )
    return ModelRunner.from_pretrained(folder, config)


class PagedDecode:
    """64 requests prefilled to 383 tokens through the ModelRunner; ``step()`` runs one decode."""

    def __init__(self, folder: Path) -> None:
        self.runner = make_runner(folder, DECODE_BATCH)
        self.planner = HandPlanner(
            block_size=BLOCK_SIZE, num_blocks=self.runner.num_kv_blocks, max_rows=DECODE_BATCH, seed=1
        )
        rng = np.random.default_rng(0)
        for _ in range(DECODE_BATCH):
            self.planner.add(
                rng.integers(0, 4096, size=DECODE_CONTEXT - 1).tolist(), SamplingParams(temperature=0.0)
            )
        for _ in range(DECODE_BATCH // 8):  # prefill 8 sequences per step
            self._run()

    def _run(self) -> float:
        plan = self.planner.next_plan()  # planning is the scheduler's job: not timed
        start = time.perf_counter()
        out = self.runner.execute(plan)
        elapsed = time.perf_counter() - start
        self.planner.record(plan, out.sampled_token_ids)
        return elapsed

    def step(self) -> float:
        return self._run()


class ContiguousDecode:
    """The same model and batch over a dense per-sequence KV cache; ``step()`` runs one decode."""

    def __init__(self, folder: Path, steps: int) -> None:
        self.model = make_runner(folder, 1).model  # same config and seed -> same weights
        self.cache = ContiguousKVCache(self.model, DECODE_BATCH, DECODE_CONTEXT + steps + 8)
        prompts = torch.randint(
            0, 4096, (DECODE_BATCH, DECODE_CONTEXT - 1), generator=torch.Generator().manual_seed(0)
        )
        for chunk in prompts.split(64, dim=1):
            logits = contiguous_step(self.model, self.cache, chunk)
        self.tokens = logits.argmax(-1, keepdim=True)

    def step(self) -> float:
        start = time.perf_counter()
        self.tokens = contiguous_step(self.model, self.cache, self.tokens).argmax(-1, keepdim=True)
        return time.perf_counter() - start


def bench_decode(folder: Path, steps: int) -> tuple[list[float], list[float]]:
    """Alternate paged and contiguous steps so both see the same machine conditions."""
    paged, contiguous = PagedDecode(folder), ContiguousDecode(folder, steps)
    paged_times, contiguous_times = [], []
    for index in range(steps + 3):  # the first 3 of each are warm-up
        paged_time, contiguous_time = paged.step(), contiguous.step()
        if index >= 3:
            paged_times.append(paged_time)
            contiguous_times.append(contiguous_time)
    return paged_times, contiguous_times


def bench_prefill(folder: Path, repeats: int) -> tuple[float, float]:
    """Tokens/s of one step with 8 prompts of 512 tokens: (paged runner, contiguous)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 4096, size=PREFILL_LENGTH).tolist() for _ in range(PREFILL_PROMPTS)]
    paged, contiguous = [], []
    for _ in range(repeats):
        runner = make_runner(folder, PREFILL_PROMPTS)
        planner = HandPlanner(
            block_size=BLOCK_SIZE, num_blocks=runner.num_kv_blocks, max_rows=PREFILL_PROMPTS
        )
        for prompt in prompts:
            planner.add(prompt, SamplingParams(temperature=0.0))
        plan = planner.next_plan()
        start = time.perf_counter()
        runner.execute(plan)
        paged.append(time.perf_counter() - start)
        cache = ContiguousKVCache(runner.model, PREFILL_PROMPTS, PREFILL_LENGTH)
        start = time.perf_counter()
        contiguous_step(runner.model, cache, torch.tensor(prompts)).argmax(-1)
        contiguous.append(time.perf_counter() - start)
    tokens = PREFILL_PROMPTS * PREFILL_LENGTH
    return tokens / min(paged), tokens / min(contiguous)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads (default: torch's, which follows OMP_NUM_THREADS)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(MODEL_CONFIG))
        paged, contiguous = bench_decode(folder, args.steps)
        prefill_paged, prefill_contiguous = bench_prefill(folder, repeats=3)
    paged_ms, contiguous_ms = statistics.median(paged) * 1e3, statistics.median(contiguous) * 1e3
    result = {
        "threads": args.threads,
        "decode_batch": DECODE_BATCH,
        "decode_context": DECODE_CONTEXT,
        "decode_step_ms_paged": round(paged_ms, 3),
        "decode_step_ms_contiguous": round(contiguous_ms, 3),
        "decode_ratio_paged_over_contiguous": round(paged_ms / contiguous_ms, 3),
        "decode_bar": 1.3,
        "decode_tokens_per_s_paged": round(DECODE_BATCH / paged_ms * 1e3, 1),
        "prefill_prompts": PREFILL_PROMPTS,
        "prefill_length": PREFILL_LENGTH,
        "prefill_tokens_per_s_paged": round(prefill_paged, 1),
        "prefill_tokens_per_s_contiguous": round(prefill_contiguous, 1),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"decode, batch {DECODE_BATCH}, context {DECODE_CONTEXT} ({args.threads} threads):")
    print(
        f"  paged ModelRunner.execute   {paged_ms:8.2f} ms/step   ({result['decode_tokens_per_s_paged']} tok/s)"
    )
    print(f"  contiguous forward + argmax {contiguous_ms:8.2f} ms/step")
    print(f"  ratio                       {result['decode_ratio_paged_over_contiguous']:8.3f}   (bar <= 1.3)")
    print(f"prefill, {PREFILL_PROMPTS} x {PREFILL_LENGTH} tokens in one step:")
    print(f"  paged      {prefill_paged:10.0f} tok/s")
    print(f"  contiguous {prefill_contiguous:10.0f} tok/s")


if __name__ == "__main__":
    main()
