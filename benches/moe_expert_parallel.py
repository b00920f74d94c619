"""Mixture-of-experts decode at tensor-parallel size 2: every expert sliced over the two
ranks (the default) against expert parallelism (``enable_expert_parallel``: four whole
experts a rank), side by side in one run.

Model: ``benches/moe.py``'s Qwen3-MoE (the bench model's shape, hidden 256, 4 layers,
``--experts`` experts of ``768 / top_k`` features, ``--top-k`` routed per token), random
weights, float32, CPU, each rank ``torch.get_num_threads() / 2`` threads (the runner's
share: one each on a 2-core host). Workload as in ``moe.py``: ``--batch``
requests of ``--prompt-len`` tokens decoding ``--output-len`` tokens, greedy. Reported:
output tokens/s of each form (median of ``--repeats`` alternating runs, a fresh engine
each) and ``expert_parallel / sliced``. Both forms all-reduce the same ``[tokens,
hidden]`` per layer; what differs is the experts' products: sliced, each rank multiplies
every routed pair by half of its expert's features; expert-parallel, each rank multiplies
the pairs routed to its own experts by whole experts (as many multiply-adds in all, but
per rank as many as its experts drew, so a step waits for the busier rank).

    python benches/moe_expert_parallel.py [--json] [--batch N] [--repeats N] [--experts N] [--top-k N]

2026-12-02, ``--json --output-len 64``, shared 2-core host at load 8-11: ratio 0.90
(3 repeats) and 1.08 (5 repeats); each form's runs spread wider than the difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

from moe import decode_rate, moe_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args(argv)
    logging.getLogger("pyengine").setLevel(logging.WARNING)
    forms = {"sliced": False, "expert_parallel": True}
    with tempfile.TemporaryDirectory() as tmp:
        folder = moe_checkpoint(Path(tmp) / "moe", args.experts, args.top_k)
        runs: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.repeats):
            for name, expert_parallel in forms.items():
                runs[name].append(decode_rate(folder, args.batch, args.prompt_len, args.output_len,
                                              tensor_parallel_size=2, enable_expert_parallel=expert_parallel))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {
        "bench": "moe_expert_parallel",
        "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "repeats": args.repeats, "experts": args.experts, "top_k": args.top_k,
                     "tensor_parallel_size": 2},
        "sliced_tokens_per_s": round(medians["sliced"], 1),
        "expert_parallel_tokens_per_s": round(medians["expert_parallel"], 1),
        "expert_parallel_over_sliced": round(medians["expert_parallel"] / medians["sliced"], 3),
        "runs_tokens_per_s": {name: [round(v, 1) for v in values] for name, values in runs.items()},
        "note": "shared, noisy CPU host: compare the ratio of the same run, not figures across runs",
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"TP=2 sliced {result['sliced_tokens_per_s']} tok/s, expert-parallel "
              f"{result['expert_parallel_tokens_per_s']} tok/s, ratio {result['expert_parallel_over_sliced']}")


if __name__ == "__main__":
    main()
