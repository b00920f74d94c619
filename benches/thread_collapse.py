"""The warning the CPU benches print when a multi-threaded engine ran slower than it
should next to its single-threaded or split counterpart: on a host with more runnable
threads than cores, libgomp's spin-wait makes an engine with several intra-op threads
collapse (``docs/tensor_parallel.md``, "TP=1 on two threads, and OpenMP"), and every ratio
against that run is then meaningless."""

from __future__ import annotations

import os


def thread_collapse_warning(what: str) -> str:
    """One line: ``what`` was seen, why, and what to run instead."""
    policy = os.environ.get("OMP_WAIT_POLICY", "the libgomp default")
    return (f"warning: {what}: the multi-threaded engine collapsed (an oversubscribed host and OpenMP's "
            f"spin-wait, OMP_WAIT_POLICY={policy}), so the ratios against it are meaningless; rerun with "
            "OMP_WAIT_POLICY=PASSIVE (docs/tensor_parallel.md) or read the ratio against one thread")
