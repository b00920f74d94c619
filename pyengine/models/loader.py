"""Load a model, its tokenizer and its EOS ids from a Hugging Face checkpoint folder.

``load_model(path, dtype="auto", device="cpu", load_format="auto")`` reads ``config.json``,
the weights (safetensors, one file or sharded with ``model.safetensors.index.json``; with
``load_format="auto"`` and no safetensors, PyTorch ``pytorch_model*.bin`` files, see
``checkpoint``), ``generation_config.json`` (EOS ids and the sampling defaults
``LoadedModel.generation_config``) and ``tokenizer.json``. ``load_format="dummy"``
fills the weights with seeded random values from the config alone (for benchmarks).
``quantization="int8"`` / ``"int4"`` quantizes the float weights once loaded
(``pyengine.models.quantization``). A ``path`` naming a ``.gguf`` file loads llama.cpp's
one-file format, quantized weights kept quantized (``quantization.gguf_load``); a folder
whose config.json has a GPTQ or AWQ ``quantization_config`` keeps its packed weights
(``quantization.quantized_folder``).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch

from pyengine.errors import InvalidConfigError
from pyengine.models.architectures import build_model
from pyengine.models.checkpoint import (
    check_names_and_shapes,
    checkpoint_files,
    checkpoint_shapes,
    iterate_shards,
)
from pyengine.models.config import DecoderConfig, parse_decoder_config
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.dtypes import normalize_dtype
from pyengine.models.errors import ModelLoadError
from pyengine.models.layers import WeightTarget, rank_rows
from pyengine.models.parallel import ParallelContext
from pyengine.models.quantization.apply import quantize_model
from pyengine.models.quantization.checkpoint_config import checkpoint_quantization
from pyengine.models.quantization.compressed_config import CompressedTensorsScheme
from pyengine.models.quantization.compressed_folder import fill_from_compressed_folder, keeps_fp8
from pyengine.models.quantization.gguf_file import is_gguf_file
from pyengine.models.quantization.online import check_method
from pyengine.models.quantization.packed import QuantizationError
from pyengine.models.quantization.quantized_folder import fill_from_quantized_folder

LoadFormat = Literal["auto", "safetensors", "dummy"]
DTypeName = Union[str, torch.dtype]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: generation_config.json keys that are sampling defaults (vLLM's list).
GENERATION_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run plus what the engine needs around it."""

    model: DecoderForCausalLM
    config: DecoderConfig
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: tuple[int, ...]
    tokenizer: Optional[Any] = None  # tokenizers.Tokenizer when tokenizer.json exists
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    # The sampling defaults of generation_config.json (GENERATION_DEFAULT_KEYS present and
    # not null, by their generation_config names); LLM.get_default_sampling_params uses
    # them unless the engine's generation_config is "vllm".
    generation_config: dict[str, Any] = field(default_factory=dict)


def resolve_dtype(dtype: DTypeName, device: torch.device) -> torch.dtype:
    """ "auto" = float32 on CPU, bfloat16 on CUDA when supported (else float16)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidConfigError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    name = normalize_dtype(dtype)
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in _DTYPES:
        raise InvalidConfigError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return _DTYPES[name]


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path.name} not found in {path.parent}") from None
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path}: invalid JSON ({error})") from error


def read_model_config(folder: Union[str, Path]) -> DecoderConfig:
    """Parse and validate ``config.json`` of a checkpoint folder (a GGUF file's metadata)."""
    if is_gguf_file(folder):
        from pyengine.models.quantization.gguf_load import read_gguf_config

        return read_gguf_config(Path(folder).expanduser())
    folder = _existing_folder(folder)
    return parse_decoder_config(read_json(folder / "config.json"))


def load_model(
    path: Union[str, Path],
    *,
    dtype: DTypeName = "auto",
    device: Union[str, torch.device] = "cpu",
    load_format: LoadFormat = "auto",
    parallel: Optional[ParallelContext] = None,
    seed: int = 0,
    quantization: Optional[str] = None,
    quantization_kernel: Optional[str] = None,
) -> LoadedModel:
    """Build the model for ``path`` and fill its weights (see the module docstring);
    ``quantization`` ("int8", "int4", "fp8") quantizes the float weights once loaded, for
    the device's kernel or ``quantization_kernel`` (``quantization.kernels``: "native",
    "int8pack", "int4pack", "scaled_mm")."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise InvalidConfigError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    if is_gguf_file(path):
        from pyengine.models.quantization.gguf_load import load_gguf_model

        if load_format != "auto":
            raise InvalidConfigError(f"load_format={load_format!r} does not apply to a GGUF file (leave it 'auto')")
        device = torch.device(device)
        return load_gguf_model(Path(path).expanduser(), resolve_dtype(dtype, device), device, parallel, quantization)
    folder = _existing_folder(path)
    config = read_model_config(folder)
    device = torch.device(device)
    # GPTQ / AWQ / compressed-tensors / fp8; others refused by name
    scheme = checkpoint_quantization(read_json(folder / "config.json"))
    if scheme is not None and quantization is not None:
        raise QuantizationError(f"quantization={quantization!r} quantizes a float checkpoint; {folder} is already "
                                f"quantized ({scheme.method}, {scheme.bits} bits): leave quantization unset")
    kernel = check_method(quantization, device, None if scheme is not None else quantization_kernel)
    keep_fp8 = scheme is not None and keeps_fp8(scheme, device, quantization_kernel)
    torch_dtype = resolve_dtype(dtype, device)
    model = instantiate_model(config, torch_dtype, device, parallel)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    elif isinstance(scheme, CompressedTensorsScheme):
        fill_from_compressed_folder(model, folder, scheme, allow_bin=load_format == "auto", keep_fp8=keep_fp8)
    elif scheme is not None:
        fill_from_quantized_folder(model, folder, scheme, allow_bin=load_format == "auto")
    else:
        load_checkpoint_weights(model, folder, allow_bin=load_format == "auto")
    if quantization is not None and kernel is not None:
        quantize_model(model, quantization, kernel)
    model.eval().requires_grad_(False)
    model.finish_loading()
    tokenizer, tokenizer_config = load_tokenizer(folder)
    generation = read_generation_config(folder)  # read once: EOS ids and sampling defaults
    return LoadedModel(
        model=model,
        config=config,
        dtype=torch_dtype,
        device=device,
        eos_token_ids=eos_token_ids(generation, config),
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
        generation_config=generation_defaults(generation),
    )


def instantiate_model(
    config: DecoderConfig,
    dtype: torch.dtype,
    device: torch.device,
    parallel: Optional[ParallelContext] = None,
) -> DecoderForCausalLM:
    """Allocate the model's parameters (uninitialised) directly on ``device`` in ``dtype``."""
    with torch.device("meta"):
        model = build_model(config, parallel)
    model = model.to_empty(device=device).to(dtype)
    # Rope tables are computed, not loaded, and stay float32 whatever the weights' dtype.
    with torch.device(device):
        model.build_rope_tables()
    return model


def fill_dummy_weights(model: DecoderForCausalLM, seed: int) -> None:
    """Seeded random weights: N(0, 0.02) for matrices and biases, ones for norms.

    Each checkpoint tensor is drawn whole, on the model's device, from a generator seeded
    by ``seed`` and the tensor's name, and this rank keeps its shard of it: every
    tensor-parallel size gets the same model (at the price of one whole tensor in memory
    at a time)."""
    device = model.embed_tokens.weight.device
    with torch.no_grad():
        model.zero_padding()
        for name, dest in model.weight_targets().items():
            if not dest.held:
                continue
            dtype = dest.parameter.dtype
            if name.endswith("norm.weight"):
                full = torch.ones(dest.checkpoint_shape, dtype=dtype, device=device)
            else:
                generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(dest.checkpoint_shape, dtype=dtype, device=device)
                full.normal_(0.0, 0.02, generator=generator)
            cut = _cut(dest)
            copy_into_target(dest, rank_rows(dest, full if cut is None else full.narrow(*cut)))


def load_checkpoint_weights(model: DecoderForCausalLM, folder: Path, *, allow_bin: bool = True) -> None:
    """Copy checkpoint tensors into the model, after checking names and shapes all at once."""
    files = checkpoint_files(folder, allow_bin=allow_bin)
    shapes = checkpoint_shapes(files)
    targets = model.weight_targets()
    check_names_and_shapes(targets, shapes, model.is_ignorable_checkpoint_tensor)
    wanted = {name: _cut(dest) for name, dest in targets.items() if dest.held}
    with torch.no_grad():
        model.zero_padding()
        for name, tensor in iterate_shards(files, wanted):
            copy_into_target(targets[name], rank_rows(targets[name], tensor))


def _cut(dest: WeightTarget) -> Optional[tuple[int, int, int]]:
    """(dim, start, size) of the checkpoint tensor this rank reads; None: all of it (a
    fused tensor is read whole, then cut per part by ``rank_rows``)."""
    if dest.shard_dim is None or dest.shard is None:
        return None
    if dest.shard.start == 0 and dest.shard.size == dest.shard.full:
        return None
    return dest.shard_dim, dest.shard.start, dest.shard.size


def copy_into_target(dest: WeightTarget, tensor: torch.Tensor) -> None:
    """``tensor`` into its parameter (into its rows there, for one part of a merged projection)."""
    target = dest.parameter.data
    if dest.row_offset is not None:
        target = target.narrow(0, dest.row_offset, tensor.shape[0])
    target.copy_(tensor)


def read_generation_config(folder: Path) -> dict[str, Any]:
    """generation_config.json of ``folder`` ({} when it is absent)."""
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    generation = read_json(path)
    if not isinstance(generation, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return generation


def eos_token_ids(generation: dict[str, Any], config: DecoderConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json's ``eos_token_id`` when it has one, else config.json's."""
    eos = generation.get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list) and eos:
        return tuple(int(token) for token in eos)
    return config.eos_token_ids


def generation_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults of a generation_config.json (``GENERATION_DEFAULT_KEYS`` present
    and not null, by their generation_config names)."""
    return {key: generation[key] for key in GENERATION_DEFAULT_KEYS if generation.get(key) is not None}


def load_tokenizer(folder: Path) -> tuple[Optional[Any], dict[str, Any]]:
    """``tokenizers.Tokenizer`` from tokenizer.json (None when absent) and tokenizer_config.json."""
    tokenizer_config_path = folder / "tokenizer_config.json"
    tokenizer_config = read_json(tokenizer_config_path) if tokenizer_config_path.exists() else {}
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.exists():
        return None, tokenizer_config
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tokenizer_path)), tokenizer_config
    except Exception as error:  # tokenizers raises its own Exception subclass
        raise ModelLoadError(f"{tokenizer_path}: cannot be read by `tokenizers` ({error})") from error


def _existing_folder(path: Union[str, Path]) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    return folder
