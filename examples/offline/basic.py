"""Generate text for a few prompts: the smallest offline program.

    python examples/offline/basic.py

``LLM()`` with no model loads pyengine's built-in tiny checkpoint (random weights, so the
text is noise); pass a checkpoint folder or a hub id, e.g. ``LLM("Qwen/Qwen3-0.6B")``.
"""

from pyengine import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=0)


def main() -> None:
    llm = LLM()  # or LLM("Qwen/Qwen3-0.6B")
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 60)
    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt:    {output.prompt!r}")
        print(f"Output:    {completion.text!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
        print("-" * 60)
    llm.shutdown()


if __name__ == "__main__":
    main()
