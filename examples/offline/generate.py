"""Generate with engine arguments and sampling parameters from the command line.

    python examples/offline/generate.py [--model MODEL] [--max-tokens N] [--temperature T]
        [--top-p P] [--top-k K] [ENGINE FLAGS: --dtype, --max-model-len, --tokenizer, ...]

Engine flags are ``EngineConfig``'s fields, as ``pyengine serve`` takes them (see
``--help``). For a batch from a file, ``pyengine generate --input prompts.jsonl`` does the
same from the shell.
"""

import argparse

from pyengine import LLM
from pyengine.cli.engine_flags import add_engine_flags, engine_kwargs


def parse_args() -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the built-in tiny one)")
    sampling = parser.add_argument_group("sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    engine_names = add_engine_flags(parser)
    args = parser.parse_args()
    engine_args = engine_kwargs(args, engine_names)
    return args, engine_args


def main() -> None:
    args, engine_args = parse_args()
    llm = LLM(args.model, **engine_args)
    sampling_params = llm.get_default_sampling_params()
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        if getattr(args, name) is not None:
            setattr(sampling_params, name, getattr(args, name))

    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 60)
    for output in outputs:
        print(f"Prompt:    {output.prompt!r}\nOutput:    {output.outputs[0].text!r}")
        print("-" * 60)
    llm.shutdown()


if __name__ == "__main__":
    main()
