"""Embeddings: one pooled, normalised vector per prompt (``LLM.embed``; ``LLM.encode`` is
the same call under vLLM's other name).

    python examples/offline/embed.py [--model MODEL]

pyengine pools a decoder's last hidden state (``PoolingParams(pooling_type="last")``,
or "mean" / "cls"); it has no classification, scoring or reward heads.
"""

import argparse
import math

from pyengine import LLM, PoolingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the built-in tiny one)")
    args = parser.parse_args()

    llm = LLM(args.model, runner="pooling")
    outputs = llm.embed(prompts, PoolingParams(pooling_type="mean"), use_tqdm=False)
    print("-" * 60)
    for prompt, output in zip(prompts, outputs):
        vector = output.outputs.embedding
        norm = math.sqrt(sum(x * x for x in vector))
        shown = ", ".join(f"{x:+.3f}" for x in vector[:4])
        print(f"Prompt: {prompt!r}\nEmbedding: [{shown}, ...] ({len(vector)} dims, norm {norm:.3f})")
        print("-" * 60)
    same = llm.encode(prompts[:1], use_tqdm=False)[0].outputs.embedding
    print(f"encode() gives a {len(same)}-dim vector too")
    llm.shutdown()


if __name__ == "__main__":
    main()
