"""Structured outputs: what constraining every request costs.

Model: the bench-sized Qwen3-shaped random checkpoint of ``throughput.py`` (hidden 256,
4 layers, vocab 4096, float32, CPU). Workload: ``--num-requests`` prompts (random tokens,
32-128 long), ``--max-num-seqs`` running together (default 64), each constrained by one of
four JSON schemas of the kinds clients send (a record to extract, an order with a bounded
array, a classification with enums, a tool call's arguments), compact JSON
(``disable_any_whitespace``), temperature 1 with a seed per request. Outputs are not
detokenized (``detokenize=False``) in either run: the random model's unconstrained tokens
are mostly ids the small tokenizer does not know, whose text costs the output thread far
more than JSON's, which would flatter the constrained run.

Measured in one engine, alternately ``--repeats`` times:

- ``constrained``: the workload, 100% constrained; each request generates until its
  schema is complete (or ``--max-tokens``).
- ``unconstrained``: the same prompts asking for exactly the number of tokens each
  constrained request generated (``ignore_eos``), so both runs compute the same tokens.
- ``large_vocabulary_masks``: the bench model's tokenizer is small; this drives the
  scheduler alone (no model) with the same schemas over a synthetic 151,936-token
  BPE-like vocabulary (Qwen's size), ``--max-num-seqs`` constrained sequences sampling
  random allowed tokens, and times each step's masks on the scheduler thread.

Reported: throughput of each (output tokens per second, medians) and their ratio (bar:
constrained >= 0.90 of unconstrained; vLLM's own measurement with async scheduling keeps
0.68 at 100% structured requests); the mask time per step on the scheduler thread
(p50/p99), the executor's wait for it, the share of it hidden behind the forward pass;
the compile time per schema, cold (first compile in a fresh engine) and cached; and the
share of the executor's busy time that masks cost it (applying them, waiting for them),
a figure the host's noise does not swing the way it swings two throughputs.

    python benches/structured.py [--json] [--num-requests 128] [--max-num-seqs 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_model import bench_checkpoint

from pyengine import LLM, SamplingParams, StructuredOutputsParams

SCHEMAS: dict[str, dict] = {
    "extract_person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
            "city": {"type": "string", "maxLength": 16},
        },
        "required": ["name", "age", "email", "city"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "maxLength": 8},
            "items": {
                "type": "array",
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 6},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "express": {"type": "boolean"},
        },
        "required": ["order_id", "items", "express"],
        "additionalProperties": False,
    },
    "classify": {
        "type": "object",
        "properties": {
            "label": {"enum": ["billing", "bug", "feature_request", "question", "other"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "keywords": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["label", "confidence", "keywords"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {"location": {"type": "string", "maxLength": 20},
                               "unit": {"enum": ["celsius", "fahrenheit"]},
                               "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                "required": ["location", "unit", "days"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}


def constraint(name: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=SCHEMAS[name], disable_any_whitespace=True)


def workload(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(rng.integers(32, 129))).tolist() for _ in range(n)]


def timed(llm: LLM, prompts, params) -> tuple[float, list, float]:
    """Wall seconds, the outputs, and the executor thread's busy seconds."""
    busy = llm.stats().threads["pyengine-exec"]["busy_s"]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, outs, llm.stats().threads["pyengine-exec"]["busy_s"] - busy


def compile_times(llm: LLM) -> dict[str, dict[str, float]]:
    """Cold: the first compile of each schema in this engine; cached: the same again."""
    out = {}
    for name in SCHEMAS:
        cold = llm.engine_core.constraints.compile(constraint(name))
        cached = llm.engine_core.constraints.compile(constraint(name))
        assert not cold.cached and cached.cached
        out[name] = {"cold_ms": 1e3 * cold.compile_seconds, "cached_ms": 1e3 * cached.compile_seconds}
    return out


def large_vocabulary(size: int, seed: int) -> list[bytes]:
    """A synthetic BPE-like vocabulary of ``size`` ids: the 256 bytes, then words (half
    with a leading space), numbers and JSON-ish punctuation runs, 2-10 bytes each."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)
    digits = np.frombuffer(b"0123456789", dtype=np.uint8)
    punct = np.frombuffer(b'{}[]":,._-/ ', dtype=np.uint8)
    tokens = {bytes([b]) for b in range(256)}
    while len(tokens) < size:
        kind = rng.integers(0, 10)
        length = int(rng.integers(2, 11))
        pool = digits if kind == 0 else punct if kind == 1 else letters
        word = bytes(rng.choice(pool, length))
        tokens.add(b" " + word[:-1] if kind > 1 and rng.integers(0, 2) else word)
    return sorted(tokens, key=lambda t: (len(t), t))[:size]


def large_vocabulary_masks(vocab_size: int, batch: int, steps: int) -> dict[str, float]:
    """Mask time per step for ``batch`` constrained sequences over a ``vocab_size``
    vocabulary (Qwen-sized by default), the scheduler alone: what a step's masks cost the
    scheduler thread with a real model's vocabulary, which the bench model lacks."""
    from pyengine import Request, Scheduler, SchedulerConfig
    from pyengine._sched import GrammarCompiler

    words = large_vocabulary(vocab_size - 1, seed=1) + [b"<|eos|>"]
    eos = vocab_size - 1
    started = time.perf_counter()
    compiler = GrammarCompiler(words, [eos], [eos], vocab_size)
    vocab_seconds = time.perf_counter() - started
    compile_ms = {}
    for name in SCHEMAS:
        c = compiler.compile("json", json.dumps(SCHEMAS[name]), disable_any_whitespace=True)
        compile_ms[name] = 1e3 * c.compile_seconds
    s = Scheduler(SchedulerConfig(4096, block_size=16, max_num_seqs=batch, max_model_len=1024,
                                  max_num_batched_tokens=8192))
    names = list(SCHEMAS)
    rng = np.random.default_rng(2)
    for i in range(batch):
        c = compiler.compile("json", json.dumps(SCHEMAS[names[i % 4]]), disable_any_whitespace=True)
        s.add_request(Request(f"r{i}", [1, 2, 3], max_tokens=200, constraint=c))
    per_step, rows = [], []
    for _ in range(steps):
        plan = s.schedule()
        if plan is None:
            break
        bits, seconds = plan.grammar_mask.take(10.0)
        per_step.append(seconds)
        rows.append(bits.shape[0])
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        sampled = np.array([rng.choice(np.flatnonzero(r)) for r in allowed], dtype=np.int64)
        s.apply_result(plan.step_id, sampled)
    per_step.sort()
    return {
        "vocab_size": vocab_size,
        "vocabulary_build_ms": 1e3 * vocab_seconds,
        "steps": len(per_step),
        "rows_per_step_mean": float(np.mean(rows)) if rows else 0.0,
        "mask_ms_p50": 1e3 * per_step[len(per_step) // 2],
        "mask_ms_p99": 1e3 * per_step[min(len(per_step) - 1, int(0.99 * len(per_step)))],
        "compile_cold_ms": compile_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large-vocab", type=int, default=151936,
                        help="vocabulary of the scheduler-only mask timing (0 skips it)")
    args = parser.parse_args()
    logging.getLogger("pyengine").setLevel(logging.WARNING)
    prompts = workload(args.num_requests, seed=0)
    names = list(SCHEMAS)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, detokenize=False,
                       structured_outputs=constraint(names[i % 4]))
        for i in range(args.num_requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_checkpoint(Path(tmp) / "bench")
        with LLM(str(folder), dtype="float32", max_num_seqs=args.max_num_seqs, max_model_len=512) as llm:
            compiled = compile_times(llm)
            llm.generate(prompts[:4], constrained[:4], use_tqdm=False)  # warm-up
            runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
            tokens = 0
            exec_busy = 0.0
            finish: dict[str, int] = {}
            for _ in range(args.repeats):
                seconds, outs, busy = timed(llm, prompts, constrained)
                exec_busy += busy
                lengths = [len(o.outputs[0].token_ids) for o in outs]
                for o in outs:
                    finish[o.outputs[0].finish_reason] = finish.get(o.outputs[0].finish_reason, 0) + 1
                tokens = sum(lengths)
                runs["constrained"].append(tokens / seconds)
                free = [SamplingParams(temperature=1.0, seed=i, max_tokens=m, ignore_eos=True, detokenize=False)
                        for i, m in enumerate(lengths)]
                seconds, outs, _ = timed(llm, prompts, free)
                assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens
                runs["unconstrained"].append(tokens / seconds)
            masks = llm.engine_core.runner.grammar_masks.summary()
            # What constraining adds to the executor's own time: applying masks, and waiting
            # for those not ready when sampling came (the window holds every constrained step).
            mask_exec_s = masks.get("apply_s_total", 0.0) + masks.get("wait_s_total", 0.0)
            sched = llm.stats().scheduler
    large = large_vocabulary_masks(args.large_vocab, args.max_num_seqs, 60) if args.large_vocab else None
    constrained_tps = statistics.median(runs["constrained"])
    free_tps = statistics.median(runs["unconstrained"])
    result = {
        "workload": {"requests": args.num_requests, "max_num_seqs": args.max_num_seqs,
                     "output_tokens": tokens, "schemas": names, "finish_reasons": finish},
        "unconstrained_tokens_per_s": free_tps,
        "constrained_tokens_per_s": constrained_tps,
        "throughput_ratio": constrained_tps / free_tps,
        "bar": 0.90,
        "runs": runs,
        "mask_per_step": {k: v for k, v in masks.items()},
        "masks_per_step_mean": sched["masks_computed"] / max(1, sched["mask_steps"]),
        "executor_time_share_of_masks": mask_exec_s / exec_busy if exec_busy else 0.0,
        "grammar_dead_ends": sched["grammar_dead_ends"],
        "compile": compiled,
        "large_vocabulary_masks": large,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"output tokens per run: {tokens} ({args.num_requests} requests, {args.max_num_seqs} at a time)")
    print(f"unconstrained: {free_tps:8.0f} tok/s   constrained: {constrained_tps:8.0f} tok/s   "
          f"ratio {result['throughput_ratio']:.3f} (bar >= 0.90)")
    print(f"mask per step (scheduler thread): p50 {masks.get('compute_ms_p50', 0):.3f} ms, "
          f"p99 {masks.get('compute_ms_p99', 0):.3f} ms; executor wait p50 {masks.get('wait_ms_p50', 0):.3f} ms, "
          f"p99 {masks.get('wait_ms_p99', 0):.3f} ms; hidden {100 * masks.get('hidden_fraction', 0):.1f}%")
    print(f"masks' share of the executor's busy time (apply + wait): "
          f"{100 * result['executor_time_share_of_masks']:.1f}%")
    for name, t in compiled.items():
        print(f"compile {name:15s} cold {t['cold_ms']:7.2f} ms   cached {t['cached_ms']:6.3f} ms")
    if large:
        print(f"{large['vocab_size']}-token vocabulary, {args.max_num_seqs} constrained sequences, scheduler only: "
              f"mask per step p50 {large['mask_ms_p50']:.2f} ms, p99 {large['mask_ms_p99']:.2f} ms; "
              f"vocabulary built in {large['vocabulary_build_ms']:.0f} ms")


if __name__ == "__main__":
    main()
