"""Read the tensors of a Hugging Face checkpoint: safetensors (preferred) or PyTorch ``.bin``.

Either format comes as one file or sharded with an index (``model.safetensors.index.json``,
``pytorch_model.bin.index.json``). When a folder holds both, the safetensors files are read.
``.bin`` files are read with ``torch.load(weights_only=True)`` (no arbitrary pickled code),
memory-mapped when the file allows it. A file that cannot be read (truncated, corrupt, not
a state dict) raises :class:`ModelLoadError` naming it.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from pyengine.models.errors import ModelLoadError, WeightMismatchError

INDEX_FILE = "model.safetensors.index.json"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
# *.bin files that trainers leave next to the weights and that are not weights.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "scheduler.bin", "scaler.bin")


def checkpoint_files(folder: Path, *, allow_bin: bool = True) -> list[Path]:
    """The weight files of a checkpoint: safetensors (named by the index, else every
    *.safetensors), else (``allow_bin``) PyTorch .bin files (named by their index, else
    every *.bin)."""
    formats = ((INDEX_FILE, "*.safetensors"), (BIN_INDEX_FILE, "*.bin"))
    for index_name, pattern in formats if allow_bin else formats[:1]:
        index = folder / index_name
        if index.exists():
            return _indexed_files(index)
        files = sorted(p for p in folder.glob(pattern) if p.is_file() and not _is_not_weights(p))
        if files:
            return files
    if not allow_bin:
        bins = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {', '.join(bins)}: load_format='auto' reads them)" if bins else ""
        raise ModelLoadError(f"no *.safetensors weights in {folder}{hint}")
    other = sorted(p.name for p in folder.glob("*.pt")) + sorted(p.name for p in folder.glob("*.pth"))
    hint = f" (found {', '.join(other)}: only *.safetensors and *.bin are read)" if other else ""
    raise ModelLoadError(f"no *.safetensors or *.bin weights in {folder}{hint}")


def _is_not_weights(path: Path) -> bool:
    return path.name in _NOT_WEIGHTS or path.name.startswith("rng_state")


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ModelLoadError(f"{index}: not a valid checkpoint index ({error})") from error
    files = sorted({index.parent / name for name in weight_map.values()})
    absent = [str(path.name) for path in files if not path.exists()]
    if absent:
        raise ModelLoadError(f"{index} names files that do not exist: {', '.join(absent)}")
    return files


def checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor (safetensors: from the headers; .bin: memory-mapped)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        for name, shape in _file_shapes(path):
            if name in shapes:
                raise ModelLoadError(f"tensor {name} appears in more than one checkpoint file ({path.name})")
            shapes[name] = shape
    return shapes


def iterate_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor, one file open at a time."""
    for path in files:
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        yield name, handle.get_tensor(name)
            except ModelLoadError:
                raise
            except Exception as error:  # safetensors raises its own SafetensorError
                raise _unreadable(path, "safetensors", error) from error
        else:
            yield from load_bin(path).items()


def iterate_shards(
    files: list[Path], wanted: dict[str, Optional[tuple[int, int, int]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for each tensor in ``wanted``, cut to ``(dim, start, size)`` (None:
    the whole tensor). From safetensors only those rows are read (``get_slice``): a
    tensor-parallel rank never reads the other ranks' shards. ``.bin`` files have no such
    access: they are read whole (memory-mapped) and narrowed."""
    for path in files:
        if path.suffix != ".safetensors":
            for name, tensor in load_bin(path).items():
                if name in wanted:
                    yield name, _narrow(tensor, wanted[name])
            continue
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    if name in wanted:
                        yield name, _read_slice(handle, name, wanted[name])
        except ModelLoadError:
            raise
        except Exception as error:  # safetensors raises its own SafetensorError
            raise _unreadable(path, "safetensors", error) from error


def _read_slice(handle: Any, name: str, cut: Optional[tuple[int, int, int]]) -> torch.Tensor:
    if cut is None:
        return handle.get_tensor(name)
    dim, start, size = cut
    index = (slice(None),) * dim + (slice(start, start + size),)
    return handle.get_slice(name)[index]


def _narrow(tensor: torch.Tensor, cut: Optional[tuple[int, int, int]]) -> torch.Tensor:
    return tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2])


def _file_shapes(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    if path.suffix != ".safetensors":
        return [(name, tuple(tensor.shape)) for name, tensor in load_bin(path).items()]
    try:
        with safe_open(str(path), framework="pt") as handle:
            return [(name, tuple(handle.get_slice(name).get_shape())) for name in handle.keys()]
    except Exception as error:  # SafetensorError, OSError
        raise _unreadable(path, "safetensors", error) from error


def load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch state dict file, read with ``weights_only=True`` and memory-mapped when it
    is in the zip format (files written by torch < 1.6 are read whole)."""
    try:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        detail = str(error).partition("WeightsUnpickler error:")[2].strip().split("\n\n")[0] or _first_line(error)
        raise ModelLoadError(
            f"{path}: refused by torch.load(weights_only=True): it is corrupt or holds objects other "
            f"than tensors ({detail})"
        ) from error
    except Exception as error:  # RuntimeError (zip reader), EOFError, OSError, ...
        raise _unreadable(path, "a PyTorch checkpoint", error) from error
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ModelLoadError(f"{path}: not a state dict (expected a mapping of names to tensors)")
    return state


def _unreadable(path: Path, kind: str, error: BaseException) -> ModelLoadError:
    return ModelLoadError(f"{path}: cannot be read as {kind}; truncated or corrupt? ({_first_line(error)})")


def _first_line(error: BaseException) -> str:
    """The first sentence of an error's message (torch's run to several paragraphs)."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0].split(". ")[0].rstrip(".")


def check_names_and_shapes(
    targets: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    ignorable: Callable[[str], bool],
    extra_missing: Iterable[str] = (),
    extra_wrong: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
) -> None:
    """Every target (each with a ``checkpoint_shape``) present in ``shapes`` with its shape,
    and nothing else there but what ``ignorable`` accepts; all that is wrong reported at
    once (WeightMismatchError). ``extra_*``: a caller's own findings, reported with them."""
    missing = sorted([name for name in targets if name not in shapes] + list(extra_missing))
    unexpected = sorted(name for name in shapes if name not in targets and not ignorable(name))
    wrong = sorted(
        [(name, t.checkpoint_shape, shapes[name]) for name, t in targets.items()
         if name in shapes and tuple(shapes[name]) != t.checkpoint_shape] + list(extra_wrong)
    )
    if missing or unexpected or wrong:
        raise WeightMismatchError(missing, unexpected, wrong)
