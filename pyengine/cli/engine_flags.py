"""``EngineConfig``'s fields as command-line flags, for every command that builds an engine.

``pyengine serve``, ``pyengine core`` (an engine-core process, maybe on a host of its own)
and ``pyengine generate`` take the same engine flags (``--max-num-seqs 64``,
``--dtype bfloat16``, ``--no-enable-prefix-caching``...). They are the engine's
configuration, not the server's: this module imports the config and nothing of the web
stack, so a core process or the batch tool parses its flags without loading it (vLLM's
``EngineArgs.add_cli_args`` does the same).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pyengine.config import EngineConfig

_SKIP = {"model"}  # the commands' positional argument
# Help for the engine flags a vLLM user looks for (the rest: EngineConfig's docstring).
_HELP = {
    "tokenizer": "a tokenizer folder or hub id other than the model's (its chat_template.jinja too)",
    "generation_config": "'auto' (default): the checkpoint's generation_config.json sampling defaults for "
                         "requests that leave them unset; 'vllm': ignore them; or a folder with another one",
    "tensor_parallel_size": "split the model over N ranks (N-1 worker processes on this host)",
    "enable_expert_parallel": "with tensor parallelism, give each rank whole MoE experts (num_experts / N of "
                              "them) instead of a slice of every expert",
    "dtype": "auto, float32 (float), bfloat16, float16 (half)",
    "quantization": "quantize a float checkpoint's linear weights at load: int8 (per channel) or int4 "
                    "(group 128), weight-only, or fp8 (e4m3 weights and per-token activations)",
    "speculative_config": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}' (docs/speculative_decoding.md)",
    "kv_events_config": "KV-cache events for prefix-aware routers, vLLM's JSON: '{\"enable_kv_cache_events\": "
                        "true, \"endpoint\": \"tcp://*:5557\"}' (docs/kv_events.md)",
}
_TYPES = {"int": int, "float": float, "str": str, "Optional[int]": int, "Optional[float]": float}


def add_engine_flags(parser: argparse.ArgumentParser) -> list[str]:
    """EngineConfig's fields as flags, all defaulting to None (unset: the config's
    default); returns their names, for ``engine_kwargs``."""
    group = parser.add_argument_group("engine arguments (EngineConfig)")
    names = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        kind = str(f.type)
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=_HELP.get(f.name))
        else:
            group.add_argument(flag, type=_TYPES.get(kind, str), default=None, metavar=f.name.upper(),
                               help=_HELP.get(f.name))
        names.append(f.name)
    return names


def engine_kwargs(ns: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The engine flags that were given, as ``EngineConfig.from_kwargs`` keywords."""
    return {name: getattr(ns, name) for name in names if getattr(ns, name) is not None}
