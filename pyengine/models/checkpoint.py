"""Read the tensors of a Hugging Face safetensors checkpoint (single file or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pyengine.models.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({error})") from error
        files = sorted({folder / name for name in weight_map.values()})
        absent = [str(path.name) for path in files if not path.exists()]
        if absent:
            raise ModelLoadError(f"{index} names files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {', '.join(other)}: only safetensors checkpoints are supported)" if other else ""
        raise ModelLoadError(f"no *.safetensors weights in {folder}{hint}")
    return files


def checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor, read from the file headers (no data loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if name in shapes:
                    raise ModelLoadError(
                        f"tensor {name} appears in more than one checkpoint file ({path.name})"
                    )
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def iterate_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor, one file open at a time."""
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
