"""Tool-call parsing: what reading a streamed answer's calls costs the front end.

Each parser (``pyengine/server/tool_parsers``) is fed a long answer in pieces of
``--chars-per-piece`` characters (about one token of an English BPE), as the server feeds
it one choice's deltas: three calls whose arguments hold a 40-item array of objects with
strings that contain braces and quotes (the JSON scanner's worst case: every character
is looked at), plus content before them for ``hermes``. Reported per parser: the time
per piece (the cost the server adds to one streamed token of one choice), characters
per second, and the whole-answer parse (what a non-streamed response pays), the best
of ``--repeats`` runs.

    python benches/tool_parsers.py [--json] [--chars-per-piece 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

from pyengine.server.tool_parsers import TOOL_PARSERS, parse_whole, tool_call_stream

ARGUMENTS = {"city": "Paris", "items": [{"sku": f"A{i}", "qty": i, "note": "a } and a \" in text"}
                                        for i in range(40)]}


def answer(parser: str) -> str:
    if parser == "hermes":
        call = json.dumps({"name": "lookup", "arguments": ARGUMENTS})
        return "Let me look these up.\n" + "".join(f"<tool_call>\n{call}\n</tool_call>\n" for _ in range(3))
    return "; ".join(json.dumps({"name": "lookup", "parameters": ARGUMENTS}) for _ in range(3))


def best_of(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def measure(parser: str, chars_per_piece: int, repeats: int) -> dict:
    text = answer(parser)
    pieces = [text[i:i + chars_per_piece] for i in range(0, len(text), chars_per_piece)]

    def streamed() -> None:
        stream = tool_call_stream(parser)
        for piece in pieces:
            stream.feed(piece)
        stream.finish()
        if not stream.valid or len(stream.calls) != 3:
            raise RuntimeError(f"{parser}: the benchmark's answer did not parse")

    stream_s = best_of(repeats, streamed)
    whole_s = best_of(repeats, lambda: parse_whole(tool_call_stream(parser), text))
    return {"chars": len(text), "pieces": len(pieces), "us_per_piece": round(stream_s * 1e6 / len(pieces), 2),
            "mchars_per_s_streamed": round(len(text) / stream_s / 1e6, 3),
            "whole_answer_ms": round(whole_s * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--chars-per-piece", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = {name: measure(name, args.chars_per_piece, args.repeats) for name in TOOL_PARSERS}
    if args.json:
        print(json.dumps(results))
        return
    for name, r in results.items():
        print(f"{name:12s} {r['chars']} chars in {r['pieces']} pieces: {r['us_per_piece']} us/piece streamed "
              f"({r['mchars_per_s_streamed']} Mchar/s), whole answer {r['whole_answer_ms']} ms")


if __name__ == "__main__":
    main()
