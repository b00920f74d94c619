"""What a request is made of before it reaches the engine core: prompts in their accepted
shapes, the checks a request must pass, chat templates rendered to a prompt, and the
tokenizer. Shared by ``LLM``, the async and multi-process clients and the server."""
