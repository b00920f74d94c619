"""The float32 LM head's products wider than the decode kernels (more than
``gemv.MAX_ROWS`` rows: decode batches past 48 sequences, prompt logprobs), three ways,
alternated in one run on Qwen3-0.6B's head shape (151,936 x 1024, random):

- ``onednn_packed``: oneDNN with the weight packed once (``cpu_linear``; what a float32
  model does now, at the cost of a second copy of the matrix beside the dense one the
  decode kernels read);
- ``dense_f_linear``: ``F.linear`` on the dense matrix (MKL, repacking on every call);
- ``gemv_chunks``: the decode kernel (``gemv.float_linear``) over 48-row chunks of the
  input, on the dense matrix (the matrix read once per chunk).

The second and third need no copy: the figures say what dropping it would cost. Also
reported: the bytes of the dense matrix and of oneDNN's packed one.

Usage: python benches/lm_head_paths.py [--json] [--rows 49,96,256] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import QWEN3_0_6B_SHAPE  # noqa: E402

from pyengine.models import cpu_linear, gemv  # noqa: E402


def gemv_chunks(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` through the decode kernel, ``gemv.MAX_ROWS`` rows at a time."""
    return torch.cat([gemv.float_linear(x[i:i + gemv.MAX_ROWS], weight) for i in range(0, x.shape[0], gemv.MAX_ROWS)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rows", default="49,96,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab, hidden = QWEN3_0_6B_SHAPE["vocab_size"], QWEN3_0_6B_SHAPE["hidden_size"]
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.02
    packed = cpu_linear.pack(weight)
    load_before = os.getloadavg()[0]
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
        paths: dict[str, Callable[[], torch.Tensor]] = {
            "onednn_packed": lambda x=x: cpu_linear.linear(x, packed),
            "dense_f_linear": lambda x=x: F.linear(x, weight),
            "gemv_chunks": lambda x=x: gemv_chunks(x, weight),
        }
        reference = paths["onednn_packed"]()
        for path in paths.values():  # the same logits every way (and a warm-up)
            torch.testing.assert_close(path(), reference, atol=1e-3, rtol=1e-3)
        runs: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, path in paths.items():
                start = time.perf_counter()
                path()
                runs[name].append(time.perf_counter() - start)
        median = {name: statistics.median(values) for name, values in runs.items()}
        results[rows] = {"ms": {name: round(value * 1e3, 1) for name, value in median.items()},
                         "over_onednn_packed": {name: round(value / median["onednn_packed"], 2)
                                                for name, value in median.items() if name != "onednn_packed"},
                         "runs_s": runs}
    report = {
        "workload": {"head": [vocab, hidden], "rows": list(results), "repeats": args.repeats, "threads": args.threads},
        "bytes": {"dense": weight.numel() * weight.element_size(), "onednn_packed": packed.numel() * packed.element_size()},
        "by_rows": results,
        "load_average": [load_before, os.getloadavg()[0]],
        "note": "shared, noisy machine: compare the ratios of one run, not figures across runs",
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"LM head {vocab} x {hidden}: dense {report['bytes']['dense'] / 1e6:.0f} MB, oneDNN packed copy "
          f"{report['bytes']['onednn_packed'] / 1e6:.0f} MB; {args.threads} threads, load {load_before:.1f}")
    for rows, result in results.items():
        ms, ratio = result["ms"], result["over_onednn_packed"]
        print(f"{rows:4d} rows: oneDNN packed {ms['onednn_packed']:8.1f} ms, F.linear {ms['dense_f_linear']:8.1f} ms "
              f"({ratio['dense_f_linear']:.2f}x), gemv chunks {ms['gemv_chunks']:8.1f} ms ({ratio['gemv_chunks']:.2f}x)")


if __name__ == "__main__":
    main()
