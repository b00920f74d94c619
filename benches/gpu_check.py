"""Prepared check for a CUDA machine (whole script well under 10 minutes on one GPU).

1. Parity on CUDA: tiny random checkpoints of every architecture; the paged ModelRunner
   (SDPA, float32) must produce transformers' greedy tokens; flash-attn (bfloat16), when
   installed, must agree with SDPA (bfloat16) on nearly every token. Also runs the
   CUDA-guarded pytest cases of tests/test_executor_attention.py.
2. KV sizing: blocks reported after the profiling forward.
3. Decode step time for a Qwen3-0.6B-shaped dummy model at batch 256 in bfloat16
   (context 512), for each available attention backend; flash-attn at block size 16
   (context gathered into a packed copy per layer) and at the CUDA default (256: the
   paged cache read in place), with which path each took.
4. Tensor parallelism: greedy tokens at tensor_parallel_size 2 (NCCL) equal size 1, when
   the machine has two GPUs (skipped, and said so, with one).

Usage: python benches/gpu_check.py [--json] [--skip-pytest]
       python benches/gpu_check.py --dry-run   # CPU, tiny sizes: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pyengine.executor.attention.flash import FLASH_PAGED_BLOCK_MULTIPLE, import_flash_varlen
from pyengine.executor.attention.selector import default_block_size
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner

ROOT = Path(__file__).resolve().parents[1]  # the repository, for its tests/

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
ARCHES = ("llama", "llama3", "mistral", "qwen2", "qwen3")


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], steps: int, chunk: int) -> list[list[int]]:
    planner = HandPlanner(
        block_size=runner.block_size,
        num_blocks=runner.num_kv_blocks,
        max_rows=runner.config.max_num_seqs,
        seed=3,
    )
    ids = [planner.add(p, SamplingParams(temperature=0.0)) for p in prompts]
    for _ in range(steps):
        plan = planner.next_plan(max_chunk=chunk)
        planner.record(plan, runner.execute(plan).sampled_token_ids)
    return [planner.output_tokens(i) for i in ids]


def parity(workdir: Path, device: str) -> dict:
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (45, 9, 33)]
    flash = import_flash_varlen() is not None and device == "cuda"
    for arch in ARCHES:
        path = make_tiny_checkpoint(workdir / arch, arch)
        settings = dict(device=device, max_num_seqs=4, max_model_len=512, num_kv_blocks=64)
        sdpa32 = ModelRunner.from_pretrained(
            path, ExecutorConfig(dtype="float32", attention_backend="sdpa", **settings)
        )
        ours = [t[:32] for t in greedy_tokens(sdpa32, prompts, 36, 16)]
        reference = (
            transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        )
        reference.generation_config.eos_token_id = None
        theirs = [
            reference.generate(torch.tensor([p], device=device), max_new_tokens=32, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
        entry = {"sdpa_fp32_equals_transformers": ours == theirs}
        if flash:
            for block_size in (16, 256):
                bf16 = dict(settings, dtype="bfloat16", block_size=block_size)
                a = greedy_tokens(
                    ModelRunner.from_pretrained(path, ExecutorConfig(attention_backend="sdpa", **bf16)),
                    prompts,
                    36,
                    16,
                )
                b = greedy_tokens(
                    ModelRunner.from_pretrained(path, ExecutorConfig(attention_backend="flash_attn", **bf16)),
                    prompts,
                    36,
                    16,
                )
                same = np.mean([x == y for s, f in zip(a, b) for x, y in zip(s, f)])
                entry[f"flash_vs_sdpa_bf16_token_agreement_block{block_size}"] = round(float(same), 3)
        results[arch] = entry
        print(arch, entry, flush=True)
    return results


def decode_timing(
    workdir: Path,
    backend: str,
    device: str,
    dtype: str,
    batch: int = 256,
    context: int = 512,
    steps: int = 20,
    block_size: int = 16,
) -> dict:
    folder = workdir / "qwen3-0.6b-shape"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN3_06B))
    blocks_per_seq = -(-(context + steps + 8) // block_size)
    config = ExecutorConfig(
        block_size=block_size,
        device=device,
        dtype=dtype,
        load_format="dummy",
        attention_backend=backend,
        max_num_seqs=batch,
        max_model_len=2048,
        num_kv_blocks=batch * blocks_per_seq + 16,
    )
    runner = ModelRunner.from_pretrained(folder, config)
    planner = HandPlanner(block_size=block_size, num_blocks=runner.num_kv_blocks, max_rows=batch, seed=1)
    rng = np.random.default_rng(0)
    for _ in range(batch):
        planner.add(
            rng.integers(0, QWEN3_06B["vocab_size"], size=context - 1).tolist(),
            SamplingParams(temperature=0.0),
        )
    prefill_start = time.perf_counter()
    while any(len(planner.output_tokens(i)) == 0 for i in range(1, batch + 1)):
        plan = planner.next_plan(max_tokens=8192)
        planner.record(plan, runner.execute(plan).sampled_token_ids)
    if device == "cuda":
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - prefill_start
    times = []
    for _ in range(steps + 3):
        plan = planner.next_plan()
        start = time.perf_counter()
        out = runner.execute(plan)  # returns host arrays: includes the sync
        times.append(time.perf_counter() - start)
        planner.record(plan, out.sampled_token_ids)
    step_ms = statistics.median(times[3:]) * 1e3
    result = {
        "backend": runner.attention_backend.name,
        "block_size": block_size,
        "paged_in_place": bool(getattr(runner.attention_backend, "supports_block_table", False))
        and block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0,
        "batch": batch,
        "context": context,
        "decode_step_ms": round(step_ms, 2),
        "decode_tokens_per_s": round(batch / step_ms * 1e3, 1),
        "prefill_s": round(prefill_s, 2),
    }
    print(result, flush=True)
    del runner
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def kv_sizing(workdir: Path) -> dict:
    folder = workdir / "qwen3-0.6b-shape"
    config = ExecutorConfig(
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_num_seqs=256,
        max_model_len=40960,
        gpu_memory_utilization=0.5,
    )
    runner = ModelRunner.from_pretrained(folder, config)
    result = {
        "num_kv_blocks": runner.num_kv_blocks,
        "kv_cache_gib": round(runner.kv_cache.num_bytes / 2**30, 2),
        "gpu_memory_utilization": 0.5,
    }
    print(result, flush=True)
    del runner
    torch.cuda.empty_cache()
    return result


def tensor_parallel(workdir: Path, device: str, size: int = 2) -> dict:
    """Greedy tokens at ``size`` ranks equal one rank (the engine, tiny Qwen3 checkpoint)."""
    from pyengine import LLM

    if device == "cuda" and torch.cuda.device_count() < size:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s), tensor_parallel_size {size} needs {size}"}
    folder = make_tiny_checkpoint(workdir / "tp-qwen3", "qwen3", seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(rng.integers(2, 40))).tolist() for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens, seconds = {}, {}
    for tp in (1, size):
        with LLM(str(folder), device=device, dtype="float32", tensor_parallel_size=tp, max_model_len=256) as llm:
            start = time.perf_counter()
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            seconds[tp] = round(time.perf_counter() - start, 3)
    same = float(np.mean([a == b for a, b in zip(tokens[1], tokens[size])]))
    result = {"tensor_parallel_size": size, "greedy_sequences_equal": same, "seconds": seconds}
    print(result, flush=True)
    return result


def dry_run() -> None:
    """Exercise every code path of this script on CPU with tiny sizes."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        results = parity(workdir, "cpu")
        assert all(entry["sdpa_fp32_equals_transformers"] for entry in results.values()), results
        decode_timing(workdir, "sdpa", "cpu", "float32", batch=4, context=40, steps=3)
        decode_timing(workdir, "sdpa", "cpu", "float32", batch=4, context=40, steps=3, block_size=256)
        assert tensor_parallel(workdir, "cpu")["greedy_sequences_equal"] == 1.0
    print("dry run ok")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (checks the script)")
    args = parser.parse_args()
    if args.dry_run:
        dry_run()
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flash_attn": import_flash_varlen() is not None,
    }
    print(report, flush=True)
    if not args.skip_pytest:
        code = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", str(ROOT / "tests/test_executor_attention.py")],
            # Not the repository root: `-m` puts the working directory first on sys.path, and
            # there the source folder pyengine/ (no native module) would shadow the installed one.
            cwd=ROOT / "tests",
            timeout=300,
        ).returncode
        report["pytest_attention_rc"] = code
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        report["parity"] = parity(workdir, "cuda")
        backends = ["sdpa"] + (["flash_attn"] if report["flash_attn"] else [])
        report["decode"] = [decode_timing(workdir, backend, "cuda", "bfloat16") for backend in backends]
        if report["flash_attn"]:  # the CUDA default block size: flash-attn reads the paged cache in place
            report["decode"].append(
                decode_timing(workdir, "flash_attn", "cuda", "bfloat16", block_size=default_block_size("cuda", "flash_attn"))
            )
        report["tensor_parallel"] = tensor_parallel(workdir, "cuda")
        report["kv_sizing"] = kv_sizing(workdir)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
