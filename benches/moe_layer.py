"""One mixture-of-experts layer at a decode step, against the dense MLP of the same active
size, side by side in one run: where ``benches/moe.py``'s end-to-end gap comes from.

Layers (random weights, float32, CPU, loaded through the real code from the checkpoints
of ``benches/moe.py``: the bench model and its Qwen3-MoE twin, ``--experts`` experts of
``768 / top_k`` features, ``--top-k`` routed): the dense ``GatedMLP`` (oneDNN-packed,
as the engine runs it), the ``SparseMoeBlock`` as the engine runs it (router, sort by
expert, per-expert products through the native kernels, combine), and, for comparison,
the same experts' two products as ``torch._grouped_mm`` over input-major copies of the
weights (the CPU path before the native one). ``--tokens`` (default 64) rows, as a batch
of 64 decoding.

Reported: microseconds per call, the median and the minimum of ``--calls`` timed calls
per variant, the variants alternating call by call (a shared machine's load falls on all
alike); ratios to the dense MLP. The minimum is the nearer to the uncontended cost.

    python benches/moe_layer.py [--json] [--tokens N] [--calls N] [--experts N] [--top-k N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_model import bench_checkpoint
from moe import moe_checkpoint

from pyengine.models.layers import GatedMLP
from pyengine.models.loader import load_model
from pyengine.models.moe import SparseMoeBlock


def _first(model: torch.nn.Module, kind: type) -> torch.nn.Module:
    return next(module for module in model.modules() if isinstance(module, kind))


def grouped_mm_products(block: SparseMoeBlock):
    """The block's routed experts as two ``torch._grouped_mm`` over input-major copies."""
    experts = block.experts
    count, hidden, local = experts.num_experts, experts.hidden_size, experts.part.size
    gate_up = experts.gate_up.detach().view(count, 2 * local, hidden).transpose(1, 2).contiguous()
    down = experts.down.detach().view(count, hidden, local).transpose(1, 2).contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:
        routing = block.gate(x)
        tokens, top_k = routing.expert_ids.shape
        flat = routing.expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x.index_select(0, order // top_k)
        offsets = torch.cumsum(torch.bincount(flat, minlength=count), 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(rows, gate_up, offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, down, offs=offsets)
        unsorted = torch.empty_like(out).index_copy_(0, order, out).view(tokens, top_k, hidden)
        return torch.bmm(routing.weights.unsqueeze(1), unsorted).squeeze(1)

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dense_model = load_model(bench_checkpoint(Path(tmp) / "dense"), dtype="float32").model
        moe_model = load_model(moe_checkpoint(Path(tmp) / "moe", args.experts, args.top_k), dtype="float32").model
    dense_model.pack_for_cpu()
    moe_model.pack_for_cpu()
    dense, block = _first(dense_model, GatedMLP), _first(moe_model, SparseMoeBlock)
    x = torch.randn(args.tokens, dense.gate_up_proj.input_size, generator=torch.Generator().manual_seed(0))
    variants = {"dense_mlp": dense, "moe_block": block, "moe_grouped_mm_copies": grouped_mm_products(block)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        torch.testing.assert_close(block(x), variants["moe_grouped_mm_copies"](x), rtol=1e-4, atol=1e-4)
        for _ in range(10):
            for run in variants.values():
                run(x)
        for _ in range(args.calls):
            for name, run in variants.items():
                start = time.perf_counter()
                run(x)
                times[name].append((time.perf_counter() - start) * 1e6)
    median = {name: statistics.median(values) for name, values in times.items()}
    minimum = {name: min(values) for name, values in times.items()}
    result = {
        "bench": "moe_layer",
        "workload": {"tokens": args.tokens, "calls": args.calls, "experts": args.experts, "top_k": args.top_k,
                     "threads": torch.get_num_threads()},
        "median_us": {name: round(value, 1) for name, value in median.items()},
        "min_us": {name: round(value, 1) for name, value in minimum.items()},
        "median_over_dense": {name: round(value / median["dense_mlp"], 2) for name, value in median.items()},
        "min_over_dense": {name: round(value / minimum["dense_mlp"], 2) for name, value in minimum.items()},
        "note": "shared, noisy CPU host: compare the ratios of the same run",
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name in variants:
            print(f"{name}: median {result['median_us'][name]} us ({result['median_over_dense'][name]}x dense), "
                  f"min {result['min_us'][name]} us ({result['min_over_dense'][name]}x)")


if __name__ == "__main__":
    main()
