"""Exceptions raised while reading a model configuration or checkpoint."""

from __future__ import annotations

from pyengine.errors import ModelLoadError

__all__ = ["ModelLoadError", "UnsupportedModelError", "WeightMismatchError"]


class UnsupportedModelError(ModelLoadError):
    """The configuration asks for something this engine does not implement."""


class WeightMismatchError(ModelLoadError):
    """Checkpoint tensors do not match the model: lists every problem at once."""

    def __init__(
        self,
        missing: list[str],
        unexpected: list[str],
        wrong_shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        self.missing = missing
        self.unexpected = unexpected
        self.wrong_shapes = wrong_shapes
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {_short_list(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): {_short_list(unexpected)}")
        if wrong_shapes:
            shapes = [f"{name} expected {list(want)} got {list(got)}" for name, want, got in wrong_shapes]
            parts.append(f"wrong shapes ({len(wrong_shapes)}): {_short_list(shapes)}")
        super().__init__("checkpoint does not match the model: " + "; ".join(parts))


def _short_list(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
