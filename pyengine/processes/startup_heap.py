"""Keeps the objects a long-running process made while starting out of the garbage
collector's full passes.

A full (oldest-generation) collection walks every tracked object. A server's front end
holds a few hundred thousand of them once it has imported torch, transformers, FastAPI
and built its tokenizer; walking them takes 120-190 ms on a CPU, with the GIL held, and
streaming allocates enough for a full pass every few seconds. Measured in the front end
under ``benches/serve_vs_offline.py``: two such passes per run, each holding every stream
and every new request for 130 ms. ``gc.freeze`` moves what is alive after start-up into
a permanent generation that collections skip; what is allocated later is collected as
before.

Only processes that pyengine owns from start to end call this (the server's process and
an engine core's): objects frozen there and dropped later in a reference cycle are never
reclaimed, which a user's interpreter creating and dropping engines must not get.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collects what start-up left as garbage, then freezes everything still alive."""
    gc.collect()
    gc.freeze()
