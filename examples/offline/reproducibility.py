"""Reproducible sampling: a request with a ``seed`` draws the same tokens every time,
whatever else runs in the same batch; without one, each run draws anew.

    python examples/offline/reproducibility.py [--model MODEL]

pyengine needs no environment variable for this (vLLM's example sets
VLLM_ENABLE_V1_MULTIPROCESSING=0): each seeded request has its own random stream.
"""

import argparse

from pyengine import LLM, SamplingParams

prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the built-in tiny one)")
    args = parser.parse_args()

    llm = LLM(args.model, seed=0)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=42)
    first = [o.outputs[0].text for o in llm.generate(prompts, seeded, use_tqdm=False)]
    # The same seeded request again, alone and in a batch with unseeded ones.
    alone = llm.generate(prompts[0], seeded, use_tqdm=False)[0].outputs[0].text
    mixed = llm.generate([prompts[0], *prompts[1:]], [seeded, SamplingParams(temperature=1.0, max_tokens=12),
                                                       SamplingParams(temperature=1.0, max_tokens=12)],
                         use_tqdm=False)[0].outputs[0].text
    llm.shutdown()

    for prompt, text in zip(prompts, first):
        print(f"{prompt!r}: {text!r}")
    if not (alone == mixed == first[0]):
        raise SystemExit("a seeded request drew different tokens")
    print("the seeded request drew the same tokens alone, in its batch and beside unseeded ones")


if __name__ == "__main__":
    main()
