"""Quantized weights on CUDA (issue 26), for a session with a GPU lent: one script, under
5 minutes on an H200. Nothing here ran yet: the CPU development machine has no GPU, so
these paths are written, and tested on CPU only (tests/test_quantization_kernels.py).

1. Correctness of each CUDA kernel against float (``--check``): for fp8 (``_scaled_mm``,
   compute capability 8.9+), int8 (``_weight_int8pack_mm``) and int4 (tinygemm), on a
   random 4096 x 4096 weight and bfloat16 activations of 1 and 32 rows: the relative
   error of the product against float32 on the dequantized weight (fp8 also against the
   emulated product, ``emulated_fp8_linear``, which rounds the activations alike), and of
   ``dequantize()`` of the repacked weight against the PackedWeight's own (tinygemm's
   nibble order). Then a tiny Qwen3 through the loader on CUDA in bfloat16, prefill logits
   against transformers (float32, CPU) on the dequantized weights.
2. Decode tokens/s (``--bench``): bfloat16, fp8, int8 and int4 weights of a Qwen3-0.6B-
   shaped model (8 layers, dummy weights) or an 8B Llama-shaped one (``--shape llama-8b``,
   32 layers), batch 1 and 32, each method in its own child process, median step, ratios
   to bfloat16 side by side.

Usage: python benches/cuda_quantized.py [--json] [--check] [--bench] [--shape ...] [--steps N]
(neither flag: both). Prints what failed and exits 1 if a check is off its bound.
``--dry-run``: the same on CPU (the kernels' CPU forms, a small weight, the tiny bench
model, 3 steps): checks the script itself; its figures mean nothing for CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_model import QWEN3_06B_SHAPED
from decode_bandwidth import decode_steps

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner

METHODS = ("bfloat16", "fp8", "int8", "int4")
# bfloat16 activations against float32: a few bf16 ulps of the sums (2^-8 relative each).
PRODUCT_BOUND = {"fp8": 0.08, "int8": 0.02, "int4": 0.02}
EMULATED_BOUND = 0.02
# --dry-run: the CPU forms of the kernels (CUDA picks these by default).
CPU_KERNELS = {"fp8": "scaled_mm", "int8": "int8pack", "int4": "int4pack"}
TINY = {**QWEN3_06B_SHAPED, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_kernels(device: str) -> dict[str, Any]:
    from pyengine.models.quantization.fp8 import emulated_fp8_linear
    from pyengine.models.quantization.kernels import KernelTarget, choose_kernel, prepare_weight
    from pyengine.models.quantization.linear import QuantizedMatmul
    from pyengine.models.quantization.online import quantize_weight

    torch.manual_seed(0)
    target = KernelTarget.of(device)
    size = 4096 if device == "cuda" else 512
    w = torch.randn(size, size, device=device)
    out: dict[str, Any] = {"capability": list(target.capability or ())}
    for method in ("fp8", "int8", "int4"):
        try:
            kernel = choose_kernel(method, target, None if device == "cuda" else CPU_KERNELS[method])
        except Exception as error:  # noqa: BLE001 - reported, e.g. fp8 below capability 8.9
            out[method] = {"skipped": str(error)}
            continue
        logical = quantize_weight(w, method)
        matmul = QuantizedMatmul(prepare_weight(logical, kernel))
        dense = logical.dequantize()
        entry: dict[str, Any] = {"kernel": kernel,
                                 "dequantize_vs_packed": _relative(matmul.weight.dequantize(), dense)}
        for rows in (1, 32):
            x = torch.randn(rows, size, device=device, dtype=torch.bfloat16)
            y = matmul(x)
            entry[f"rows{rows}_vs_float"] = _relative(y, x.float() @ dense.t())
            if method == "fp8":
                entry[f"rows{rows}_vs_emulated"] = _relative(y, emulated_fp8_linear(x.float(), logical))
        out[method] = entry
    out["model"] = check_model([m for m in ("fp8", "int8", "int4") if "skipped" not in out[m]], device)
    out["failures"] = _failures(out)
    return out


def check_model(methods: list[str], device: str) -> dict[str, Any]:
    from pyengine.testing.checkpoints import make_tiny_checkpoint
    from pyengine.testing.dequantized import write_dequantized_checkpoint
    from pyengine.testing.hand_plan import prefill_alone
    from pyengine.testing.transformers_reference import reference_logits

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_checkpoint(Path(tmp) / "m", "qwen3", hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        prompt = list(range(3, 73))
        for method in methods:
            runner = ModelRunner.from_pretrained(folder, ExecutorConfig(
                device=device, dtype="bfloat16", max_num_seqs=8, max_model_len=256, num_kv_blocks=64,
                quantization=method))
            reference = write_dequantized_checkpoint(runner.model, folder, Path(tmp) / f"deq-{method}")
            _, ours = prefill_alone(runner, prompt)
            theirs = reference_logits(reference, prompt)
            ours = ours.float().cpu()
            results[method] = {"rms_over_std": float((ours - theirs).pow(2).mean().sqrt() / theirs.std()),
                               "top_token_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}
            del runner
    return results


def _failures(out: dict[str, Any]) -> list[str]:
    failures = []
    for method, bound in PRODUCT_BOUND.items():
        entry = out.get(method, {})
        for key, value in entry.items():
            if key.endswith("_vs_float") and value > bound:
                failures.append(f"{method} {key} {value:.4f} > {bound}")
            if key.endswith("_vs_emulated") and value > EMULATED_BOUND:
                failures.append(f"{method} {key} {value:.4f} > {EMULATED_BOUND}")
            if key == "dequantize_vs_packed" and value > 0.01:
                failures.append(f"{method} dequantize() {value:.4f} off the PackedWeight's (layout wrong?)")
    for method, entry in out.get("model", {}).items():
        if entry["rms_over_std"] > 0.2:  # bfloat16 (and fp8 activations) through two layers
            failures.append(f"{method} model logits rms/std {entry['rms_over_std']:.3f} > 0.2")
    return failures


def one_method(method: str, shape: str, steps: int, device: str) -> dict[str, Any]:
    config_json = {"llama-8b": LLAMA_8B, "qwen3-0.6b-8layers": QWEN3_06B_SHAPED, "tiny": TINY}[shape]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config_json))
        result = {}
        for batch in (1, 32):
            runner = ModelRunner.from_pretrained(folder, ExecutorConfig(
                device=device, dtype="bfloat16", max_num_seqs=32, max_model_len=1024, num_kv_blocks=32 * 512 // 16,
                load_format="dummy", quantization=None if method == "bfloat16" else method))
            times = decode_steps(runner, batch, steps)
            result[f"decode_batch{batch}_tokens_per_s"] = round(batch / statistics.median(times), 1)
            del runner
            if device == "cuda":
                torch.cuda.empty_cache()
    return result


def bench(shape: str, steps: int, dry_run: bool) -> dict[str, Any]:
    results: dict[str, Any] = {"shape": shape, "steps": steps}
    for method in METHODS:
        command = [sys.executable, __file__, "--one", method, "--shape", shape, "--steps", str(steps)]
        child = subprocess.run(command + (["--dry-run"] if dry_run else []), capture_output=True, text=True,
                               timeout=240)
        if child.returncode != 0:
            results[method] = {"failed": child.stderr[-2000:]}
            continue
        results[method] = json.loads(child.stdout.strip().splitlines()[-1])
    base = results.get("bfloat16", {})
    if "decode_batch1_tokens_per_s" in base:
        results["ratios_to_bfloat16"] = {
            m: {f"batch{b}": round(results[m][f"decode_batch{b}_tokens_per_s"] / base[f"decode_batch{b}_tokens_per_s"], 2)
                for b in (1, 32)}
            for m in METHODS if "decode_batch1_tokens_per_s" in results[m]
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--shape", choices=("qwen3-0.6b-8layers", "llama-8b", "tiny"), default="qwen3-0.6b-8layers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="on CPU, to check the script (figures meaningless)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("benches/cuda_quantized.py needs a CUDA device (--dry-run: CPU)")
    if args.one:
        print(json.dumps(one_method(args.one, args.shape, args.steps, device)))
        return
    both = not args.check and not args.bench
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    results: dict[str, Any] = {"device": name, "torch": torch.__version__}
    if args.check or both:
        results["check"] = check_kernels(device)
    if args.bench or both:
        shape, steps = ("tiny", 3) if args.dry_run else (args.shape, args.steps)
        results["bench"] = bench(shape, steps, args.dry_run)
    print(json.dumps(results, indent=None if args.json else 2))
    if results.get("check", {}).get("failures"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
