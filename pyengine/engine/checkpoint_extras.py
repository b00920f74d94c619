"""What the engine takes from a checkpoint besides the model itself, as the engine
arguments choose: the tokenizer (the model folder's, a GGUF file's metadata, or
``tokenizer=``'s folder) and the sampling defaults (``generation_config=``: the
checkpoint's generation_config.json, another folder's, or none)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pyengine.config import EngineConfig
from pyengine.errors import InvalidConfigError
from pyengine.models.loader import generation_defaults, load_tokenizer, read_generation_config
from pyengine.models.quantization.gguf_file import GGUFCheckpoint, gguf_tokenizer, is_gguf_file

#: generation_config.json's names -> SamplingParams' (the rest are the same).
_SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer the engine uses and where it came from (chat_template.jinja is read
    from ``folder``)."""

    folder: Path
    tokenizer: Optional[Any]  # tokenizers.Tokenizer, None without a tokenizer.json
    tokenizer_config: dict[str, Any]


def engine_tokenizer(config: EngineConfig, model_path: Path, loaded: Any,
                     model_vocab_size: Optional[int]) -> TokenizerFiles:
    """The model's own tokenizer (already loaded with it), or the one of ``config.tokenizer``.
    A separate tokenizer with more tokens than the model's vocabulary is an error naming it:
    its ids past the vocabulary would fail every batch they entered."""
    if config.tokenizer is None and is_gguf_file(model_path):
        return TokenizerFiles(model_path, *gguf_tokenizer(GGUFCheckpoint(model_path)))
    own = TokenizerFiles(model_path, getattr(loaded, "tokenizer", None),
                         dict(getattr(loaded, "tokenizer_config", None) or {}))
    if config.tokenizer is None or _same_folder(config.tokenizer, model_path):
        return own
    folder = Path(config.tokenizer).expanduser()
    tokenizer, tokenizer_config = load_tokenizer(folder)
    size = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer is not None else 0
    if model_vocab_size is not None and size > model_vocab_size:
        raise InvalidConfigError(
            f"tokenizer {str(config.tokenizer)!r} has {size} tokens, more than the model's vocabulary "
            f"({model_vocab_size}): it is not a tokenizer for this model"
        )
    return TokenizerFiles(folder, tokenizer, tokenizer_config)


def sampling_defaults(config: EngineConfig, loaded: Any) -> dict[str, Any]:
    """The default ``SamplingParams`` fields (by SamplingParams' names) that
    ``generation_config`` asks for: the checkpoint's ("auto", parsed with the model),
    none ("vllm"), or those of the folder it names."""
    if config.generation_config == "vllm":
        return {}
    if config.generation_config == "auto":
        found = getattr(loaded, "generation_config", None)  # a synthetic runner has none
        found = found if isinstance(found, dict) else {}
    else:
        found = generation_defaults(read_generation_config(Path(config.generation_config).expanduser()))
    return {_SAMPLING_NAMES.get(key, key): value for key, value in found.items()}


def _same_folder(a: Any, b: Path) -> bool:
    try:
        return Path(a).expanduser().resolve() == b.expanduser().resolve()
    except (OSError, RuntimeError):
        return False
