"""Output-thread text cost per token: flat in the output length, or not.

Streams outputs of several lengths one token per step (as the output thread does) through
each detokenization path and prints microseconds per token. A path whose per-token cost
does not depend on the output length shows the same figure in every column; the naive
full re-decode is there to show what growth looks like.

    python benches/detokenize.py                 # table
    python benches/detokenize.py --lengths 100 2000 8000 --json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pyengine.models.default_tokenizer import train_tokenizer
from pyengine.text import DecodeTable, IncrementalDetokenizer, TextStream

TEXT = (
    "The scheduler plans the next step while the executor runs this one. "
    "你好，世界！今天天气很好。日本語のテキスト、こんにちは。한국어 문장도 있습니다. "
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 and rare ones 🧬 🫠 鬱 mixed with numbers 123 4567. "
)
PROMPT = "<|im_start|>user\nTell me a story in three languages.<|im_end|>\n<|im_start|>assistant\n"

# One function per path: given the prompt and output ids, stream the output one id per step.
Path = Callable[[list[int], list[int]], None]


def _paths(tokenizer: Tokenizer, table: DecodeTable) -> dict[str, Path]:
    window_table = DecodeTable.window_only(tokenizer)  # force the generic fallback

    def byte_table(prompt: list[int], ids: list[int]) -> None:
        detokenizer = IncrementalDetokenizer(table, prompt)
        for token_id in ids:
            detokenizer.add((token_id,))
        detokenizer.flush()

    def window(prompt: list[int], ids: list[int]) -> None:
        detokenizer = IncrementalDetokenizer(window_table, prompt)
        for token_id in ids:
            detokenizer.add((token_id,))
        detokenizer.flush()

    def text_stream(prompt: list[int], ids: list[int]) -> None:
        stream = TextStream(table, prompt, stop=["</answer>", "\n\nUser:"])
        for token_id in ids:
            stream.add((token_id,))
        stream.finish()

    def hf_decode_stream(prompt: list[int], ids: list[int]) -> None:
        stream = DecodeStream(skip_special_tokens=True)
        for token_id in ids:
            stream.step(tokenizer, token_id)

    def full_redecode(prompt: list[int], ids: list[int]) -> None:
        decoded = ""
        for end in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:end])
            decoded = text if not text.endswith("\ufffd") else decoded

    return {
        "IncrementalDetokenizer (byte table)": byte_table,
        "IncrementalDetokenizer (window fallback)": window,
        "TextStream (byte table + 2 stop strings)": text_stream,
        "tokenizers.DecodeStream (reference)": hf_decode_stream,
        "full re-decode each step (naive)": full_redecode,
    }


def _us_per_token(
    path: Path, prompt: list[int], outputs: dict[int, list[int]], min_tokens: int
) -> dict[int, float]:
    """Best of 7 rounds per output length; the lengths alternate within a round, so that a
    busy machine slows them alike. A round streams about ``min_tokens`` tokens per length
    (at least one sequence: the naive path is quadratic)."""
    best = {n: float("inf") for n in outputs}
    for _ in range(7):
        for n, ids in outputs.items():
            repeats = max(1, min_tokens // n)
            start = time.perf_counter()
            for _ in range(repeats):
                path(prompt, ids)
            best[n] = min(best[n], (time.perf_counter() - start) / (repeats * n))
    return {n: seconds * 1e6 for n, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[100, 2000], help="output lengths in tokens"
    )
    parser.add_argument(
        "--min-tokens", type=int, default=20_000, help="tokens streamed per measurement round"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()

    tokenizer = train_tokenizer(512)
    start = time.perf_counter()
    table = DecodeTable.from_tokenizer(tokenizer)
    build_ms = (time.perf_counter() - start) * 1e3
    prompt = tokenizer.encode(PROMPT).ids
    text_ids = tokenizer.encode(TEXT).ids
    outputs = {n: (text_ids * (n // len(text_ids) + 1))[:n] for n in args.lengths}

    if not args.json:
        print(
            f"tokenizer: byte-level BPE, {len(table.token_bytes or ())} ids; DecodeTable built in {build_ms:.1f} ms"
        )
        header = "".join(f"{f'{n} tok':>12}" for n in args.lengths)
        print(f"{'path (µs per token)':<44}{header}")
    for name, path in _paths(tokenizer, table).items():
        budget = args.min_tokens if "naive" not in name else 0
        figures = _us_per_token(path, prompt, outputs, budget)
        if args.json:
            print(json.dumps({"path": name, "us_per_token": figures}))
        else:
            print(f"{name:<44}" + "".join(f"{us:>12.2f}" for us in figures.values()))


if __name__ == "__main__":
    main()
