"""``pyengine generate``: offline batch generation from the command line.

Prompts come from ``--prompt`` (repeatable), or a file / stdin (``--input FILE`` or
``--input -``): one prompt per line as plain text, or JSON lines (JSONL), each an object
with ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (a chat, rendered with the
chat template), an optional ``id``, and any ``SamplingParams`` field for that request
alone (``{"prompt": "Hi", "max_tokens": 8, "temperature": 0.7}``). ``--input-format auto``
(the default) reads a line that starts with ``{`` as JSON and any other as text.

Results go to stdout or ``--output FILE``: JSON lines in input order (``--output-format
jsonl``, the default with ``--input``), or a readable listing (``text``, the default
otherwise). Engine arguments are ``EngineConfig``'s fields as flags, as for ``pyengine
serve``; sampling flags set what a JSONL line does not, over the checkpoint's
generation_config.json defaults. Progress goes to stderr: a bar of generated tokens on a
terminal, a line every few seconds otherwise (``pyengine.entrypoints.progress``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Optional, TextIO

from pyengine.errors import InvalidRequestError

DEMO_PROMPTS = [
    "The three threads of an inference engine are",
    "你好，世界！",
    "Once upon a time",
    "def fibonacci(n):",
]
#: Sampling flags (SamplingParams fields) and their types; unset flags leave the defaults.
#: (--seed is the engine's, as vLLM's; a JSONL line may set its own "seed".)
_SAMPLING_FLAGS = {
    "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float, "n": int,
    "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "min_tokens": int,
    "logprobs": int,
}
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


@dataclasses.dataclass
class _Item:
    line: int  # 1-based line of the input (0: --prompt / demo)
    request_id: Optional[str]
    prompt: Any  # str, {"prompt_token_ids": [...]}, or a chat (list of messages)
    is_chat: bool
    overrides: dict[str, Any]


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    from pyengine.cli.engine_flags import add_engine_flags

    parser = argparse.ArgumentParser(prog="pyengine generate", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="JSONL line: {\"prompt\": \"...\" | \"prompt_token_ids\": [...] | "
                                     "\"messages\": [...], \"id\": \"...\", SamplingParams fields...}")
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint folder or hub id ORG/NAME (default: the built-in tiny model)")
    parser.add_argument("--model", default=None, help="the same as MODEL")
    source = parser.add_argument_group("prompts")
    source.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few demo prompts")
    source.add_argument("--input", default=None, metavar="FILE", help="read prompts from FILE ('-': stdin)")
    source.add_argument("--input-format", choices=("auto", "text", "jsonl"), default="auto",
                        help="text: a prompt per line; jsonl: a JSON object per line; auto: JSON when a line "
                        "starts with '{'")
    source.add_argument("--chat", action="store_true",
                        help="text prompts are user messages, rendered with the chat template")
    out = parser.add_argument_group("output")
    out.add_argument("--output", default=None, metavar="FILE", help="write results to FILE (default: stdout)")
    out.add_argument("--output-format", choices=("text", "jsonl"), default=None,
                     help="jsonl (default with --input) or text (default otherwise)")
    out.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    out.add_argument("--stats", action=argparse.BooleanOptionalAction, default=None,
                     help="the engine's figures at the end (default: with text output, after it on stdout; "
                     "with JSONL, --stats puts them on stderr)")
    sampling = parser.add_argument_group("sampling (over the checkpoint's generation_config.json defaults)")
    for name, kind in _SAMPLING_FLAGS.items():
        sampling.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    sampling.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", default=None)
    return parser, add_engine_flags(parser)


def main(argv: list[str]) -> int:
    parser, engine_names = build_parser()
    ns = parser.parse_args(argv)
    if ns.model and ns.model_arg and ns.model != ns.model_arg:
        parser.error(f"two models given: {ns.model_arg!r} and --model {ns.model!r}")
    if ns.input is not None and ns.prompt:
        parser.error("--prompt and --input cannot be combined")
    model = ns.model or ns.model_arg
    from pyengine.cli.engine_flags import engine_kwargs

    engine_args = engine_kwargs(ns, engine_names)
    flags = {name: getattr(ns, name) for name in (*_SAMPLING_FLAGS, "stop", "ignore_eos")
             if getattr(ns, name) is not None}
    _check_sampling(flags, {}, "sampling flags")
    items = _read_items(ns, flags)  # input errors before the model loads
    output_format = ns.output_format or ("jsonl" if ns.input is not None else "text")
    want_stats = ns.stats if ns.stats is not None else output_format == "text"
    from pyengine import LLM
    from pyengine.entrypoints.progress import TokenProgress

    with LLM(model, **engine_args) as llm:
        base = llm.get_default_sampling_params()
        params = [_params(base, flags, item) for item in items]
        results: list[Any] = [None] * len(items)
        for is_chat in (True, False):  # chats first, then the plain prompts; written in input order
            picked = [i for i, item in enumerate(items) if item.is_chat == is_chat]
            if not picked:
                continue
            progress = False if ns.no_progress else TokenProgress("chat" if is_chat else "generate")
            run = llm.chat if is_chat else llm.generate
            outs = run([items[i].prompt for i in picked], [params[i] for i in picked], use_tqdm=progress)
            for i, out in zip(picked, outs):
                results[i] = out
        stats = llm.stats() if want_stats else None
    stream = open(ns.output, "w", encoding="utf-8") if ns.output else sys.stdout  # noqa: SIM115
    try:
        for i, (item, out) in enumerate(zip(items, results)):
            _write(stream, output_format, i, item, out)
    finally:
        if stream is not sys.stdout:
            stream.close()
    if stats is not None:
        _print_stats(stats, sys.stdout if output_format == "text" and not ns.output else sys.stderr)
    return 0


def _read_items(ns: argparse.Namespace, flags: dict[str, Any]) -> list[_Item]:
    """The prompts, each JSON line's fields checked (with the sampling ``flags`` under them)."""
    if ns.input is None:
        return [_Item(0, None, _chat(p) if ns.chat else p, ns.chat, {}) for p in (ns.prompt or DEMO_PROMPTS)]
    if ns.input == "-":
        lines = sys.stdin.read().splitlines()
        where = "stdin"
    else:
        try:
            with open(ns.input, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except OSError as error:
            raise InvalidRequestError(f"--input {ns.input!r} cannot be read ({error.strerror or error})") from None
        where = ns.input
    items = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        as_json = ns.input_format == "jsonl" or (ns.input_format == "auto" and line.lstrip().startswith("{"))
        items.append(_json_item(line, number, where, flags) if as_json else
                     _Item(number, None, _chat(line) if ns.chat else line, ns.chat, {}))
    if not items:
        raise InvalidRequestError(f"--input {where}: no prompts in it")
    return items


def _json_item(line: str, number: int, where: str, flags: dict[str, Any]) -> _Item:
    from pyengine.sampling_params import SamplingParams

    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"{where} line {number}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise InvalidRequestError(f"{where} line {number}: expected a JSON object, got {type(row).__name__}")
    given = [key for key in _PROMPT_KEYS if key in row]
    if len(given) != 1:
        raise InvalidRequestError(f"{where} line {number}: needs exactly one of {', '.join(_PROMPT_KEYS)}"
                                  + (f" (got {', '.join(given)})" if given else ""))
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    overrides = {k: v for k, v in row.items() if k not in (*_PROMPT_KEYS, "id")}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise InvalidRequestError(f"{where} line {number}: unknown field(s) {', '.join(unknown)} (a line holds a "
                                  f"prompt, an id and SamplingParams fields)")
    _check_sampling(flags, overrides, f"{where} line {number}")
    key = given[0]
    prompt: Any = row[key] if key != "prompt_token_ids" else {"prompt_token_ids": row[key]}
    request_id = None if row.get("id") is None else str(row["id"])
    return _Item(number, request_id, prompt, key == "messages", overrides)


def _check_sampling(flags: dict[str, Any], overrides: dict[str, Any], where: str) -> None:
    """Raises ``InvalidRequestError`` naming ``where`` when the command line's sampling
    flags, with a line's own fields over them, are no valid ``SamplingParams`` (the
    checkpoint's defaults under both are known only once the model loads, and checked then)."""
    from pyengine.sampling_params import SamplingParams

    try:
        SamplingParams(**{**flags, **overrides})
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"{where}: {error}") from None


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _params(base: Any, flags: dict[str, Any], item: _Item) -> Any:
    """The checkpoint's defaults, then the command line's flags, then the line's own fields."""
    params = dataclasses.replace(base, **flags) if flags else base
    if not item.overrides:
        return params
    try:
        return dataclasses.replace(params, **item.overrides)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"line {item.line}: {error}") from None


def _write(stream: TextIO, output_format: str, index: int, item: _Item, out: Any) -> None:
    if output_format == "jsonl":
        row = {
            "id": item.request_id if item.request_id is not None else str(index),
            "prompt": out.prompt,
            "prompt_token_ids": list(out.prompt_token_ids or []),
            "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs],
        }
        stream.write(json.dumps(row, ensure_ascii=False) + "\n")
        return
    for c in out.outputs:
        stream.write(f"--- {out.prompt!r}\n    -> {c.text!r}\n    ({len(c.token_ids)} tokens, finish: "
                     f"{c.finish_reason})\n")


def _print_stats(stats: Any, stream: TextIO) -> None:
    print("--- engine stats", file=stream)
    for name, t in stats.threads.items():
        print(f"  {name:<16} busy {t['busy_s']:.3f} s, idle {t['idle_s']:.3f} s", file=stream)
    print(f"  steps {stats.steps}, step time mean {stats.step_time_mean_ms:.2f} ms / p99 "
          f"{stats.step_time_p99_ms:.2f} ms", file=stream)
    print(f"  tokens: {stats.prompt_tokens} prompt, {stats.generated_tokens} generated; KV blocks "
          f"{stats.kv_blocks_total}, prefix-cache hit rate {stats.prefix_cache_hit_rate:.1%}, preemptions "
          f"{stats.preemptions}", file=stream)
