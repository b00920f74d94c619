"""Mixture-of-experts decode throughput against a dense model with the same active
parameters, side by side in one run.

Models (random weights, float32, CPU): the bench model of ``bench_model`` (Qwen3-shaped,
hidden 256, 4 layers, MLP intermediate 768) and a Qwen3-MoE of the same shape whose MLPs
are ``--experts`` experts of ``768 / top_k`` features each, ``--top-k`` (default 2 of 8)
routed per token: per token it multiplies by as many MLP weights as the dense model
(plus the 8 x 256 router). Attention, embeddings and head are identical.

Workload: ``--batch`` (default 64) requests of ``--prompt-len`` (16) random tokens, each
decoding ``--output-len`` (128) tokens, greedy, ignore_eos, all in one batch
(``max_num_seqs`` = batch). Reported: output tokens per second (prefill is 1/8 of the
tokens and one step), the median of ``--repeats`` runs that alternate dense and MoE (a
fresh engine each, start-up and a warm-up not timed), and ``moe / dense``.

Bar: MoE >= 0.7x the dense model's tokens/s. ``--quantization int8`` (or ``int4``) runs
both models quantized at load (the MoE's routed experts included).

    python benches/moe.py [--json] [--batch N] [--repeats N] [--experts N] [--top-k N]
                          [--quantization int8|int4]
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
from bench_model import MODEL, VOCAB_SIZE, bench_checkpoint

from pyengine import LLM, SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint


def moe_checkpoint(folder: Path, experts: int, top_k: int) -> Path:
    """The bench model's shape with experts in every layer: the same active MLP size."""
    dense_inter = MODEL["intermediate_size"]
    if dense_inter % top_k:
        raise SystemExit(f"--top-k {top_k} must divide the dense intermediate size {dense_inter}")
    shape = {key: value for key, value in MODEL.items() if key != "intermediate_size"}
    return make_tiny_checkpoint(
        folder, "qwen3_moe", vocab_size=VOCAB_SIZE, intermediate_size=dense_inter,
        moe_intermediate_size=dense_inter // top_k, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, mlp_only_layers=[], **shape,
    )


def decode_rate(folder: Path, batch: int, prompt_len: int, output_len: int,
                quantization: str | None = None, **engine) -> float:
    """Output tokens per second for one batch of ``batch`` requests (``engine``: more
    engine arguments, e.g. ``tensor_parallel_size``)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB_SIZE, prompt_len).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with LLM(str(folder), dtype="float32", max_num_seqs=batch, max_model_len=prompt_len + output_len + 16,
             quantization=quantization, **engine) as llm:
        llm.generate(prompts[:batch], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    produced = sum(len(out.outputs[0].token_ids) for out in outs)
    if produced != batch * output_len:
        raise SystemExit(f"expected {batch * output_len} tokens, got {produced}")
    return produced / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--quantization", choices=["int8", "int4"], default=None)
    args = parser.parse_args(argv)
    logging.getLogger("pyengine").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        dense = bench_checkpoint(Path(tmp) / "dense")
        moe = moe_checkpoint(Path(tmp) / "moe", args.experts, args.top_k)
        runs: dict[str, list[float]] = {"dense": [], "moe": []}
        for _ in range(args.repeats):
            for name, folder in (("dense", dense), ("moe", moe)):
                runs[name].append(decode_rate(folder, args.batch, args.prompt_len, args.output_len, args.quantization))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["moe"] / medians["dense"]
    result = {
        "bench": "moe",
        "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "repeats": args.repeats, "experts": args.experts, "top_k": args.top_k,
                     "quantization": args.quantization},
        "dense_tokens_per_s": round(medians["dense"], 1),
        "moe_tokens_per_s": round(medians["moe"], 1),
        "moe_over_dense": round(ratio, 3),
        "bar": 0.7,
        "passes_bar": ratio >= 0.7,
        "runs_tokens_per_s": {name: [round(v, 1) for v in values] for name, values in runs.items()},
        "note": "shared, noisy CPU host: compare the ratio of the same run, not figures across runs",
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"dense {result['dense_tokens_per_s']} tok/s, moe {result['moe_tokens_per_s']} tok/s, "
              f"moe/dense {result['moe_over_dense']} (bar 0.7)")


if __name__ == "__main__":
    main()
