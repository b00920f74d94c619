"""Prefix caching: prompts sharing a long prefix reuse its KV blocks; the text is the same
with the cache on or off, and the second batch finds most of its prompt tokens cached.

    python examples/offline/prefix_caching.py [--model MODEL]
"""

import argparse

from pyengine import LLM, SamplingParams

prefix = (
    "You are an expert school principal, skilled in effectively managing faculty and staff. "
    "Draft 10-15 questions for a potential first grade Head Teacher for my K-12, all-girls', "
    "independent school that emphasizes community, joy, and hands-on learning. "
    "Candidate background: several years of teaching in New York City schools. "
)
questions = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
prompts = [prefix + question for question in questions]
greedy = SamplingParams(temperature=0.0, max_tokens=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the built-in tiny one)")
    args = parser.parse_args()

    without_cache = LLM(args.model, enable_prefix_caching=False)
    reference = [o.outputs[0].text for o in without_cache.generate(prompts, greedy, use_tqdm=False)]
    without_cache.shutdown()

    llm = LLM(args.model, enable_prefix_caching=True)
    llm.generate(prompts[0], greedy, use_tqdm=False)  # warms the cache with the shared prefix
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    cached = [o.num_cached_tokens for o in outputs]
    texts = [o.outputs[0].text for o in outputs]
    hit_rate = llm.stats().prefix_cache_hit_rate
    llm.shutdown()

    for question, text, tokens in zip(questions, texts, cached):
        print(f"{question!r}: {text!r} ({tokens} prompt tokens from the cache)")
    print(f"prefix-cache hit rate {hit_rate:.0%}")
    if texts != reference:
        raise SystemExit("the outputs differ with and without the prefix cache")
    print("the outputs are the same with and without prefix caching")


if __name__ == "__main__":
    main()
