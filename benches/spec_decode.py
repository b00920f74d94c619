"""Speculative decoding vs plain decoding, side by side in one run (docs/speculative_decoding.md).

Executor level: the real ``ModelRunner`` (verification included) driven by the hand
planner, greedy, pipeline depth 1; drafts come from a prompt-lookup (n-gram) proposer
written here in Python, the same rule as the scheduler's "ngram" method (the longest
n-gram, ``prompt_lookup_max`` down to ``prompt_lookup_min``, whose earlier occurrence is
continued for k tokens). The engine path (the Rust scheduler proposing) is measured once
it plans drafts; until then this is what can be measured.

Workloads, each at batch 1 and 16:

- ``repeat`` (drafts right): X + G + X, a random span X, the model's own greedy
  continuation G of X, and X again, so prompt lookup finds a continuation in the context.
  Whether the model continues X the same way the second time is measured, not assumed
  (the mean accepted length says it): the random-weight bench model does not; run it
  with ``--shape copy`` (``benches/copy_model.py``: a Llama whose weights are an
  induction circuit, so it continues a span it has seen) for drafts that are right;
- ``random`` (drafts wrong): random prompts;
- ``oracle`` (drafts right by construction): random prompts, each step proposed the
  plain run's own next k tokens: what verification gains when every draft is right (a
  model that copies its context, with prompt lookup), whatever the bench model's weights.

Reported per (workload, batch): decode tokens/s off and with n-gram, their ratio, mean
accepted length (1 + kept drafts per sequence-step that carried drafts), the proposer's
time per step, and a verification step's time relative to a plain decode step. The two
runs of a pair alternate step by step (the machine is shared); outputs are checked
identical to decoding without speculation.

``--engine`` measures the whole engine instead (``LLM.generate`` with and without
``speculative_config``, the scheduler proposing "ngram" / "suffix" drafts off the GIL),
each pair of engines alive together and their runs alternated; step time, mean accepted
length and proposer time come from ``llm.stats()``. ``--methods eagle3`` adds an EAGLE-3
head (the executor proposing): a random one written for the bench model in the published
layout (``pyengine.testing.eagle3_checkpoint``, a quarter of the vocabulary through
``d2t``), whose drafts are almost never right: what it measures is what the adaptive
back-off makes of a proposer that costs a head forward per draft and is always wrong.

Usage: python benches/spec_decode.py [--json] [--engine] [--shape bench|copy|qwen3-0.6b-8l]
       [--tokens N] [--k K] [--batches 1,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import QWEN3_06B_SHAPED, VOCAB_SIZE, bench_checkpoint, qwen3_06b_shaped_folder  # noqa: E402
from copy_model import COPY_RECIPE, copy_accuracy, copy_checkpoint  # noqa: E402

from pyengine.executor.config import ExecutorConfig  # noqa: E402
from pyengine.executor.model_runner import ModelRunner  # noqa: E402
from pyengine.sampling_params import SamplingParams  # noqa: E402
from pyengine.testing.hand_plan import HandPlanner  # noqa: E402

BLOCK_SIZE = 16
MODEL_NAMES = {
    "bench": "bench_model (Qwen3-shaped, hidden 256, 4 layers, vocab 4096, random weights, float32)",
    "qwen3-0.6b-8l": f"Qwen3-0.6B shapes, 8 layers, vocab {QWEN3_06B_SHAPED['vocab_size']}, dummy weights, float32",
    "copy": "copy_model (Llama, 2 layers, hidden 320, vocab 4096, an induction circuit set by hand: it continues "
            "a span it has seen; benches/copy_model.py)",
}
#: ``--methods draft_model``: a small random draft sharing the target's vocabulary (its
#: drafts are wrong); ``draft_self`` drafts with the target itself (greedy: always right).
DRAFT_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
PROMPT_LEN = 128
SPAN = 32


def ngram_drafts(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """Prompt lookup: the continuation of the latest earlier occurrence of the longest
    suffix n-gram (``high`` down to ``low`` tokens); [] when none occurs."""
    length = len(tokens)
    for n in range(min(high, length - 1), low - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def prompts_for(workload: str, batch: int, make_runner, tokens: int, seed: int = 7) -> list[list[int]]:
    """``random``: random prompts. ``repeat``: a random span X, the model's own greedy
    continuation G of it, then X again (X + G + X): a repeated span whose continuation the
    context holds, whatever the (random) weights; a model that continues X as it did
    before is proposed G by prompt lookup."""
    rng = np.random.default_rng(seed)
    if workload == "random":
        return [rng.integers(0, VOCAB_SIZE, PROMPT_LEN).tolist() for _ in range(batch)]
    spans = [rng.integers(0, VOCAB_SIZE, SPAN).tolist() for _ in range(batch)]
    first = Decoder(make_runner(), spans, tokens + 8, 0, (1, 1))
    while not first.done:
        first.step()
    return [x + first.planner.output_tokens(i) + x for x, i in zip(spans, first.ids)]


class Decoder:
    """One decode run: prefill (not timed) at construction, then ``step()`` until ``done``;
    k = 0 decodes plainly. Two decoders stepped in turn see the same machine conditions."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], tokens: int, k: int,
                 lookup: tuple[int, int], oracle: Optional[list[list[int]]] = None) -> None:
        """``oracle``: propose each sequence's next k tokens of these outputs instead of
        prompt lookup (drafts right by construction)."""
        self.runner, self.tokens, self.k, self.lookup, self.oracle = runner, tokens, k, lookup, oracle
        self.planner = HandPlanner(block_size=BLOCK_SIZE, num_blocks=runner.num_kv_blocks, max_rows=len(prompts),
                                   seed=1)
        params = SamplingParams(temperature=0.0, max_tokens=tokens + k + 1)
        self.ids = [self.planner.add(p, params) for p in prompts]
        plan = self.planner.next_plan()
        self.planner.record(plan, runner.execute(plan).sampled_token_ids)
        self.step_times: list[float] = []
        self.propose_times: list[float] = []
        self.plain_steps: list[float] = []
        self.spec_steps: list[float] = []
        self.drafted = self.kept = 0

    @property
    def done(self) -> bool:
        return min(len(self.planner.output_tokens(i)) for i in self.ids) >= self.tokens

    def step(self) -> None:
        planner = self.planner
        drafts: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        if self.k:
            for index, seq_id in enumerate(self.ids):
                if self.oracle is not None:
                    done = len(planner.output_tokens(seq_id))
                    proposal = self.oracle[index][done:done + self.k]
                else:
                    proposal = ngram_drafts(planner.tokens(seq_id), self.k, *self.lookup)
                if proposal:
                    drafts[seq_id] = proposal
        t1 = time.perf_counter()
        plan = planner.next_plan(drafts=drafts) if self.k else planner.next_plan()
        t2 = time.perf_counter()
        out = self.runner.execute(plan)
        t3 = time.perf_counter()
        planner.record(plan, out.sampled_token_ids, out.num_accepted)
        self.propose_times.append(t1 - t0)
        self.step_times.append((t1 - t0) + (t3 - t2))  # planning is the scheduler's job: not timed
        (self.spec_steps if drafts else self.plain_steps).append(t3 - t2)
        if out.num_accepted is not None:
            self.drafted += int((np.asarray(plan.num_draft_tokens) > 0).sum())
            self.kept += int(out.num_accepted.sum())

    def report(self) -> dict:
        outputs = [self.planner.output_tokens(i)[:self.tokens] for i in self.ids]
        return {
            "outputs": outputs,
            # per step: tokens emitted / the median step time (the machine is shared: a
            # median resists the other processes' bursts better than a sum)
            "tokens_per_s": sum(len(o) for o in outputs) / len(self.step_times) / statistics.median(self.step_times),
            "steps": len(self.step_times),
            "mean_accepted_length": 1 + self.kept / self.drafted if self.drafted else None,
            "proposer_ms_per_step": 1e3 * statistics.mean(self.propose_times),
            "plain_step_ms": 1e3 * statistics.median(self.plain_steps) if self.plain_steps else None,
            "verify_step_ms": 1e3 * statistics.median(self.spec_steps) if self.spec_steps else None,
        }


def side_by_side(make_runner, prompts: list[list[int]], tokens: int, k: int, lookup: tuple[int, int],
                 oracle: Optional[list[list[int]]] = None):
    """Plain and speculative decoding of the same prompts, a step of each in turn."""
    off = Decoder(make_runner(), prompts, tokens, 0, lookup)
    spec = Decoder(make_runner(), prompts, tokens, k, lookup, oracle)
    while not (off.done and spec.done):
        for decoder in (off, spec):
            if not decoder.done:
                decoder.step()
    return off.report(), spec.report()


def runner_factory(folder: Path, batch: int, load_format: str = "auto"):
    return lambda: ModelRunner.from_pretrained(folder, ExecutorConfig(
        dtype="float32", max_num_seqs=batch, max_model_len=1024, block_size=BLOCK_SIZE,
        num_kv_blocks=batch * 1024 // BLOCK_SIZE, attention_backend="sdpa", load_format=load_format))


def eagle3_head(folder: Path, scratch: Path) -> tuple[Path, dict]:
    """A random EAGLE-3 head for the target ``folder`` and what it is: vLLM's default aux
    layers where they are distinct, else the first, middle and last layers."""
    from pyengine.models.eagle3_config import default_aux_layers
    from pyengine.testing.eagle3_checkpoint import write_eagle3_head

    raw = json.loads((folder / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    aux = default_aux_layers(layers)
    if len(set(aux)) < 3 or min(aux) < 0:
        aux = (0, layers // 2, layers - 1)
    if len(set(aux)) < 3:
        raise SystemExit(f"spec_decode: an EAGLE-3 head needs a target of 3 layers or more, this one has {layers}")
    draft_vocab = raw["vocab_size"] // 4
    head = write_eagle3_head(scratch / "eagle3-head", folder, seed=0, draft_vocab_size=draft_vocab,
                             aux_layer_ids=aux)
    return head, {"eagle3_head": f"random weights (seed 0), aux layers {list(aux)}, draft vocabulary {draft_vocab} "
                                 f"of {raw['vocab_size']} through d2t"}


def engine_pair(folder: Path, method: str, prompt_sets: list[list[list[int]]], tokens: int, k: int,
                lookup: tuple[int, int], load_format: str = "auto", head: Optional[Path] = None,
                draft: Optional[Path] = None) -> dict:
    """Plain and speculative ``LLM`` engines, runs alternated, each run on its own prompt
    set (the first warms up): suffix decoding's cross-request tree must not have seen
    a run's outputs before it. The two runs of a prompt set go in turn in either order
    (off first on even sets, speculation first on odd ones), and the speed-up is the
    median of the sets' ratios: on the 2-core machine identical runs of one engine spread
    by +-15% (thread hand-offs at 1-2 ms steps), so only ratios of neighbouring runs
    resolve a few percent; the spread of those ratios is reported beside it, and the
    ratio of each engine's fastest run (the least interference)."""
    from pyengine import LLM

    spec: dict = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        spec.update(prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1])
    elif method == "eagle3":
        spec["model"] = str(head)
    elif method in ("draft_model", "draft_self"):
        spec = {**spec, "method": "draft_model", "model": str(draft if method == "draft_model" else folder)}
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    common = dict(max_num_seqs=max(16, len(prompt_sets[0])), max_model_len=1024, dtype="float32",
                  load_format=load_format)
    times: dict[str, list[float]] = {"off": [], "spec": []}
    outputs: dict[str, list] = {"off": [], "spec": []}
    with LLM(str(folder), **common) as off, LLM(str(folder), speculative_config=spec, **common) as on:
        for index, prompts in enumerate(prompt_sets):
            pair = (("off", off), ("spec", on))
            for name, llm in (pair if index % 2 == 0 else pair[::-1]):
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
                outputs[name].append([list(o.outputs[0].token_ids) for o in outs])
        off_stats, spec_stats = off.stats(), on.stats()
    sched = spec_stats.scheduler
    drafts = sched.get("spec_drafts", 0)
    generated = tokens * len(prompt_sets[0])
    off_rate = generated / statistics.median(times["off"][1:])
    spec_rate = generated / statistics.median(times["spec"][1:])
    ratios = sorted(a / b for a, b in zip(times["off"][1:], times["spec"][1:]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "identical_outputs": outputs["off"] == outputs["spec"],
        "off_tokens_per_s": round(off_rate, 1), "spec_tokens_per_s": round(spec_rate, 1),
        "speedup": round(statistics.median(ratios), 3),
        "speedup_quartiles": [round(quartiles[0], 3), round(quartiles[2], 3)],
        # the fastest run of each: what each costs with the least interference
        "speedup_best_runs": round(min(times["off"][1:]) / min(times["spec"][1:]), 3),
        "mean_accepted_length": round(1 + sched.get("spec_accepted_tokens", 0) / drafts, 3) if drafts else None,
        "proposer_ms_per_step": round(1e3 * sched.get("spec_propose_seconds", 0.0) / max(1, spec_stats.steps), 4),
        "plain_step_ms": round(off_stats.step_time_mean_ms, 3), "verify_step_ms": round(spec_stats.step_time_mean_ms, 3),
        "verify_vs_plain_step": round(spec_stats.step_time_mean_ms / off_stats.step_time_mean_ms, 3),
        # steps and pipeline bubbles (the executor waiting for a plan) over every run, warm-up included
        "steps_off": off_stats.steps, "steps_spec": spec_stats.steps,
        "bubbles_off": off_stats.pipeline_bubbles, "bubbles_spec": spec_stats.pipeline_bubbles,
        "bubble_s_off": round(off_stats.pipeline_bubble_s, 3), "bubble_s_spec": round(spec_stats.pipeline_bubble_s, 3),
        "drafted_steps": drafts,
        "disabled_sequences": sched.get("spec_disabled_sequences", 0),
        # why the adaptive rule stopped or paused rows (absent from builds before it said)
        **{key: sched[f"spec_{key}"] for key in ("disabled_low_rate", "disabled_failing", "disabled_learning", "pauses",
                                                 "backoffs", "empty_proposals") if f"spec_{key}" in sched},
    }


def main_engine(args, folder: Path, batches: list[int], lookup: tuple[int, int], load_format: str,
                extra: dict, scratch: Path) -> int:
    head = draft = None
    if "eagle3" in args.methods.split(","):
        head, described = eagle3_head(folder, scratch)
        extra = {**extra, **described}
    if "draft_model" in args.methods.split(","):
        draft = bench_checkpoint(scratch / "draft", vocab_size=json.loads((folder / "config.json").read_text())[
            "vocab_size"], seed=1, shape=DRAFT_SHAPE)
        extra = {**extra, "draft_model": f"random weights (seed 1), {DRAFT_SHAPE}"}
    results = []
    for workload in args.engine_workloads.split(","):
        for batch in batches:
            sets = [prompts_for(workload, batch, runner_factory(folder, batch, load_format), args.tokens, seed=7 + r)
                    for r in range(args.repeats + 1)]
            for method in args.methods.split(","):
                row = {"workload": workload, "batch": batch, "method": method, "k": args.k,
                       **engine_pair(folder, method, sets, args.tokens, args.k, lookup, load_format, head, draft)}
                results.append(row)
                if not args.json:
                    print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    report = {"bench": "spec_decode", "level": "engine (LLM.generate, the scheduler proposing)",
              "model": MODEL_NAMES[args.shape], **extra,
              "decode_tokens_per_seq": args.tokens, "repeats": args.repeats,
              "note": "shared, noisy machine: ratios of runs made side by side", "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if all(r["identical_outputs"] for r in results) else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per sequence")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--engine", action="store_true", help="the whole engine, the scheduler proposing")
    parser.add_argument("--repeats", type=int, default=10, help="--engine: timed runs per engine")
    parser.add_argument("--shape", choices=("bench", "copy", "qwen3-0.6b-8l"), default="bench",
                        help="copy: a model that copies its context (benches/copy_model.py; drafts right on "
                             "repeat); qwen3-0.6b-8l: Qwen3-0.6B's shapes with 8 layers, dummy weights "
                             "(memory-bound decode)")
    parser.add_argument("--engine-workloads", default="repeat,random", help="--engine: workloads")
    parser.add_argument("--methods", default="ngram,suffix", help="--engine: methods (ngram, suffix, eagle3, draft_model: a small random "
                        "draft, draft_self: the target as its own draft)")
    parser.add_argument("--workloads", default="repeat:ngram,random:ngram,random:oracle",
                        help="executor level: workload:method pairs")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    low, high = (int(x) for x in args.lookup.split(","))
    scratch = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    load_format = "auto"
    extra: dict = {}
    if args.shape == "qwen3-0.6b-8l":
        folder, load_format = qwen3_06b_shaped_folder(scratch), "dummy"
    elif args.shape == "copy":
        folder = copy_checkpoint()
        # measured, not assumed: the share of a repeated span's tokens it predicts
        extra["copy_accuracy"] = round(copy_accuracy(folder, COPY_RECIPE["vocab_size"]), 4)
    else:
        folder = bench_checkpoint(scratch)
    batches = [int(b) for b in args.batches.split(",")]
    if args.engine:
        from pyengine.errors import InvalidConfigError

        try:
            return main_engine(args, folder, batches, (low, high), load_format, extra, scratch)
        except InvalidConfigError as error:  # a build whose scheduler plans no drafts
            print(f"spec_decode --engine: {error}", file=sys.stderr)
            return 2

    def factory(batch: int):
        return runner_factory(folder, batch, load_format)

    results = []
    for workload, method in (pair.split(":") for pair in args.workloads.split(",")):
        for batch in batches:
            prompts = prompts_for(workload, batch, factory(batch), args.tokens)
            oracle = None
            if method == "oracle":  # the plain run's own tokens, computed first (not timed)
                reference = Decoder(factory(batch)(), prompts, args.tokens + args.k + 1, 0, (low, high))
                while not reference.done:
                    reference.step()
                oracle = [reference.planner.output_tokens(i) for i in reference.ids]
            off, spec = side_by_side(factory(batch), prompts, args.tokens, args.k, (low, high), oracle)
            row = {
                "workload": workload, "batch": batch, "method": method, "k": args.k,
                "identical_outputs": off["outputs"] == spec["outputs"],
                "off_tokens_per_s": round(off["tokens_per_s"], 1),
                "spec_tokens_per_s": round(spec["tokens_per_s"], 1),
                "speedup": round(spec["tokens_per_s"] / off["tokens_per_s"], 3),
                "mean_accepted_length": None if spec["mean_accepted_length"] is None
                else round(spec["mean_accepted_length"], 3),
                "proposer_ms_per_step": round(spec["proposer_ms_per_step"], 3),
                "plain_step_ms": round(off["plain_step_ms"], 3),
                "verify_step_ms": None if spec["verify_step_ms"] is None else round(spec["verify_step_ms"], 3),
                "verify_vs_plain_step": None if spec["verify_step_ms"] is None
                else round(spec["verify_step_ms"] / off["plain_step_ms"], 3),
                "steps_off": off["steps"], "steps_spec": spec["steps"],
            }
            results.append(row)
            if not args.json:
                print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    report = {"bench": "spec_decode", "level": "executor (ModelRunner + hand planner, Python n-gram proposer)",
              "model": MODEL_NAMES[args.shape], **extra,
              "decode_tokens_per_seq": args.tokens, "torch_threads": torch.get_num_threads(),
              "note": "shared, noisy machine: ratios of runs made side by side", "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if all(r["identical_outputs"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
