"""vLLM's classification example, where pyengine differs on purpose: it has no
classification heads. Run it to see the error a ported script gets, and what to do.

    python examples/offline/classify.py

(The error is the point: the script exits with status 1 and the message.)
"""

import sys

from pyengine import LLM, EngineError


def main() -> int:
    llm = LLM(runner="pooling")
    try:
        llm.classify(["Hello, my name is"])
    except EngineError as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
