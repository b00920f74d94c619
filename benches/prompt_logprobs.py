"""What prompt log-probabilities cost, and that requests not asking for them pay nothing.

Model: Qwen3-shaped random checkpoint (hidden 256, 4 layers, vocab ``--vocab``, float32,
CPU). Workload: ``--num-requests`` prompts of ``--prompt-len`` random tokens, 8 output
tokens each, greedy, ignore_eos. Measured in one run, each workload on a fresh engine
(start-up not timed), alternating, ``--repeats`` times, medians reported:

- ``none``: no request asks (the path every ordinary request takes);
- ``all``: every request asks for ``prompt_logprobs=5``;
- ``one_in_8``: every eighth request asks.

Also the executor's per-step bookkeeping for a step where no row asked
(``PromptLogprobsTable.job`` on a 256-row decode plan), in microseconds: the whole
price a request that does not ask pays.

    python benches/prompt_logprobs.py [--json] [--num-requests 64] [--prompt-len 256]
        [--vocab 32000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
from bench_model import bench_checkpoint

from pyengine import LLM, SamplingParams
from pyengine.executor.plan import HandBuiltPlan
from pyengine.executor.prompt_logprobs import PromptLogprobsTable


def run(folder: Path, prompts: list[list[int]], every: int) -> float:
    """Seconds for the workload, every ``every``-th request asking (0: none)."""
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=5)
    params = [asking if every and i % every == 0 else plain for i in range(len(prompts))]
    with LLM(str(folder), max_num_seqs=64, max_num_batched_tokens=2048) as llm:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    assert all((o.prompt_logprobs is not None) == (p is asking) for o, p in zip(outs, params))
    return elapsed


def idle_check_us(rows: int = 256, repeats: int = 2000) -> float:
    """Microseconds of ``PromptLogprobsTable.job`` for a decode step none of whose rows asked."""
    table = PromptLogprobsTable(rows, 32000)
    empty_i32, empty_i64 = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
    plan = HandBuiltPlan(
        step_id=0, rows=np.arange(rows, dtype=np.int32), num_scheduled_tokens=np.ones(rows, dtype=np.int32),
        query_start_loc=np.arange(rows + 1, dtype=np.int32), seq_lens=np.full(rows, 100, dtype=np.int32),
        input_ids=np.full(rows, -1, dtype=np.int64), positions=np.full(rows, 99, dtype=np.int64),
        slot_mapping=np.arange(rows, dtype=np.int64), logits_indices=np.arange(rows, dtype=np.int64),
        sample_rows=np.arange(rows, dtype=np.int32), pool_indices=empty_i32, block_table_rows=empty_i32,
        block_table_cols=empty_i32, block_table_ids=empty_i32, new_rows=empty_i32,
        new_seq_ids=np.zeros(0, dtype=np.uint64), new_num_prompt_tokens=empty_i32,
        new_token_offsets=np.zeros(1, dtype=np.int64), new_token_ids=empty_i64, new_params=[], freed_rows=empty_i32,
    )
    start = time.perf_counter()
    for step in range(repeats):
        plan.step_id = step
        table.job(plan)
    return (time.perf_counter() - start) / repeats * 1e6


def format_report(result: dict) -> str:
    """The plain-text report: the workload, each run's median, the ratios, the idle check."""
    w, seconds = result["workload"], result["seconds"]
    runs = result["runs"]
    lines = [f"workload: {w['num_requests']} requests of {w['prompt_len']} prompt tokens, vocab {w['vocab']}, "
             f"8 output tokens, median of {w['repeats']} run(s)"]
    for key, label in (("none", "no request asks"), ("all", "every request asks"),
                       ("one_in_8", "1 request in 8 asks")):
        lines.append(f"{label:>22}: {seconds[key]:.3f} s  (runs: {', '.join(f'{t:.3f}' for t in runs[key])})")
    lines.append(f"all / none time {result['ratio_all_over_none']:.3f}, "
                 f"1 in 8 / none time {result['ratio_one_in_8_over_none']:.3f}")
    lines.append(f"idle per-step check (256-row decode step, none asking): {result['idle_step_check_us']:.2f} µs")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, args.vocab, args.prompt_len).tolist() for _ in range(args.num_requests)]
    times: dict[str, list[float]] = {"none": [], "all": [], "one_in_8": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_checkpoint(Path(tmp) / "model", vocab_size=args.vocab)
        for _ in range(args.repeats):
            times["none"].append(run(folder, prompts, 0))
            times["all"].append(run(folder, prompts, 1))
            times["one_in_8"].append(run(folder, prompts, 8))
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "workload": {k: v for k, v in vars(args).items() if k != "json"},
        "seconds": {k: round(v, 3) for k, v in medians.items()},
        "ratio_all_over_none": round(medians["all"] / medians["none"], 3),
        "ratio_one_in_8_over_none": round(medians["one_in_8"] / medians["none"], 3),
        "idle_step_check_us": round(idle_check_us(), 2),
        "runs": {k: [round(t, 4) for t in v] for k, v in times.items()},
    }
    print(json.dumps(result) if args.json else format_report(result))


if __name__ == "__main__":
    main()
