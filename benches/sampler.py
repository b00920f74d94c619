"""Sampling cost: top-k / top-p masks from each row's best candidates vs sorting whole
rows, and a whole ``Sampler.sample`` call.

Logits are peaked like a trained model's (a power law over a random token order, plus a
little noise): the 0.95 nucleus holds a handful of tokens. For each vocabulary size and
batch: the median time of ``apply_top_k_top_p`` (candidates first, whole-row sort only
where the nucleus reaches further) next to the same masks from sorting every row whole,
whether the two agree, and the median time of ``Sampler.sample`` for temperature 0.8
alone and with top_p 0.95, every other row seeded.

    python benches/sampler.py [--json] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pyengine.executor import sampler
from pyengine.executor.sampling_table import SamplingTable
from pyengine.sampling_params import SamplingParams


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _peaked_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.rand(batch, vocab, generator=gen).argsort(-1).float() + 1
    return -2.2 * ranks.log() + 0.1 * torch.randn(batch, vocab, generator=gen)


def measure(vocab: int, batch: int, repeats: int) -> dict:
    logits = _peaked_logits(batch, vocab, seed=batch)
    top_k, top_p = torch.zeros(batch, dtype=torch.int64), torch.full((batch,), 0.95)
    whole_k = torch.full((batch,), vocab)

    def with_candidates() -> torch.Tensor:
        return sampler.apply_top_k_top_p(logits, top_k, top_p)

    def sorting_whole_rows() -> torch.Tensor:
        threshold = sampler._thresholds_by_sorting(logits, whole_k, top_p)
        return logits.masked_fill(logits < threshold, float("-inf"))

    return {
        "vocab": vocab,
        "batch": batch,
        "candidates_ms": round(_median_ms(with_candidates, repeats), 2),
        "whole_sort_ms": round(_median_ms(sorting_whole_rows, repeats), 2),
        "same_masks": torch.equal(with_candidates(), sorting_whole_rows()),
        "sample_temperature_ms": round(_sample_ms(logits, SamplingParams(temperature=0.8), repeats), 2),
        "sample_top_p_ms": round(_sample_ms(logits, SamplingParams(temperature=0.8, top_p=0.95), repeats), 2),
    }


def _sample_ms(logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    batch = logits.shape[0]
    table, rows = SamplingTable(batch, torch.device("cpu")), np.arange(batch)
    seeded = [SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=row) for row in range(batch)]
    table.install(rows, [seeded[row] if row % 2 else params for row in range(batch)])
    draw = sampler.Sampler(table, torch.Generator().manual_seed(0))
    positions = torch.zeros(batch, dtype=torch.int64)
    return _median_ms(lambda: draw.sample(logits, rows, positions, None), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    results = [measure(vocab, batch, args.repeats) for vocab in (4096, 151936) for batch in (8, 64)]
    if args.json:
        print(json.dumps({"torch_threads": torch.get_num_threads(), "results": results}))
        return
    for r in results:
        print(f"vocab {r['vocab']:>6} batch {r['batch']:>3}: masks: candidates {r['candidates_ms']:8.2f} ms, "
              f"whole-row sort {r['whole_sort_ms']:8.2f} ms ({r['whole_sort_ms'] / r['candidates_ms']:.1f}x), "
              f"same masks: {r['same_masks']}; sample: temperature {r['sample_temperature_ms']:7.2f} ms, "
              f"top_p {r['sample_top_p_ms']:7.2f} ms")


if __name__ == "__main__":
    main()
