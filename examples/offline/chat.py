"""Chat: one conversation, then a batch of them, rendered with the checkpoint's chat
template (or ``--chat-template``, a file or the template's text).

    python examples/offline/chat.py [--model MODEL] [--chat-template FILE]
"""

import argparse

from pyengine import LLM, SamplingParams


def print_outputs(outputs) -> None:
    print("-" * 60)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Reply:  {output.outputs[0].text!r}")
        print("-" * 60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the built-in tiny one)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--chat-template", default=None, help="a template file or the template itself")
    args = parser.parse_args()

    llm = LLM(args.model)
    sampling_params = llm.get_default_sampling_params()  # the checkpoint's generation_config.json defaults
    sampling_params.max_tokens = args.max_tokens  # parameters may be changed after they are built
    sampling_params.temperature = args.temperature

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    print_outputs(llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=args.chat_template))

    conversations = [conversation, [{"role": "user", "content": "What is 2 + 2?"}]]
    print_outputs(llm.chat(conversations, SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                           chat_template=args.chat_template))
    llm.shutdown()


if __name__ == "__main__":
    main()
