"""The most CPU memory a call's tensors hold at once (benches)."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch


def peak_tensor_bytes(run: Callable[[], Any]) -> int:
    """Bytes of the most CPU tensors allocated inside ``run`` that are alive at once (its
    output included), from the profiler's memory timeline. The timeline also counts the
    tensors made before ``run`` that it touches (a cache written in place) from its first
    point on; that first point is subtracted."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the timeline's CUDA replacement has no CPU form
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as prof:
            run()
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    totals = [sum(categories) for categories in sizes]
    return max(totals, default=0) - (totals[0] if totals else 0)
