"""Speculative decoding's executor proposers at tensor-parallel size 1 and 2, side by side
in one run: speculation off, the target as its own draft (every draft right), another
draft model and an EAGLE-3 head (random: drafts wrong), at each size.

Model: ``tests/test_spec_tp_proposers.py``'s checkpoints (a 4-layer tiny Llama with a
509-token vocabulary, a tiny Qwen3 draft, a random EAGLE-3 head over 300 draft tokens),
float32, CPU, one thread a rank. Workload: ``--prompts`` random prompts of 4-40 tokens,
``--output-len`` greedy tokens each, k = 3. Reported per run: whether the tokens equal
size 1 without speculation, the drafts proposed and kept, the mean accepted length, the
start-up and generate wall times (a tiny model: the times show overheads, not speed-ups).

    python benches/spec_tp.py [--json] [--prompts N] [--output-len N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from pyengine import LLM, SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.eagle3_checkpoint import write_eagle3_head

VOCAB = 509


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = make_tiny_checkpoint(root / "target", "llama", seed=1, num_hidden_layers=4, vocab_size=VOCAB)
        other = make_tiny_checkpoint(root / "draft", "qwen3", seed=5, vocab_size=VOCAB)
        head = write_eagle3_head(root / "head", target, seed=2, draft_vocab_size=300, aux_layer_ids=(0, 1, 3))
        rng = np.random.default_rng(4)
        prompts = [rng.integers(3, VOCAB, int(rng.integers(4, 40))).tolist() for _ in range(args.prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        runs = {"off": None, "draft=target": ("draft_model", target), "draft=other": ("draft_model", other),
                "eagle3": ("eagle3", head)}
        reference = None
        rows = []
        for tp in (1, 2):
            for name, proposer in runs.items():
                spec = None if proposer is None else {"method": proposer[0], "model": str(proposer[1]),
                                                      "num_speculative_tokens": 3}
                t0 = time.perf_counter()
                with LLM(str(target), tensor_parallel_size=tp, max_num_seqs=8, max_model_len=256,
                         speculative_config=spec) as llm:
                    t1 = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    t2 = time.perf_counter()
                    stats = llm.stats().scheduler
                tokens = [list(o.outputs[0].token_ids) for o in outs]
                reference = reference if reference is not None else tokens
                rows.append({"tp": tp, "run": name, "same_tokens": tokens == reference,
                             "drafts": stats.get("spec_draft_tokens", 0), "kept": stats.get("spec_accepted_tokens", 0),
                             "mean_accepted_length": round(stats.get("spec_mean_accepted_length", 0.0), 2),
                             "start_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print(" ".join(f"{key}={value}" for key, value in row.items()))


if __name__ == "__main__":
    main()
