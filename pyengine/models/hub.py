"""Hugging Face hub ids (``"Qwen/Qwen3-0.6B"``) -> a local checkpoint folder.

``resolve_model(model)`` returns ``model`` unchanged when it is an existing path, a
``Path`` object, or does not look like a hub id (``ORG/NAME``); otherwise it asks
``huggingface_hub`` for the snapshot folder:

1. the local cache first (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``), never touching the network;
2. with ``HF_HUB_OFFLINE=1`` that is all, else the hub: the files the engine reads
   (config, tokenizer, generation config, chat template and the weights: safetensors when
   the repository has them, else ``pytorch_model*.bin``) are downloaded into the cache.

A failure is a :class:`ModelLoadError` naming the id and saying what to do. The
environment is read at each call (not when ``huggingface_hub`` was imported), so tests can
point it at a cache in a temporary folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Union

from pyengine.models.errors import ModelLoadError

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_TRUE = ("1", "true", "yes", "on")
# Top-level files the loader reads, besides the weights.
_SIDE_FILES = re.compile(
    r"(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"
    r"|added_tokens\.json|vocab\.json|merges\.txt|tokenizer\.model|.*\.jinja|.*\.tiktoken)"
)


def looks_like_hub_id(model: object) -> bool:
    """A string ``ORG/NAME`` (hub's characters, no ``..`` or ``--``) that is not an existing path."""
    return (
        isinstance(model, str)
        and _HUB_ID.fullmatch(model) is not None
        and ".." not in model
        and "--" not in model
        and not model.endswith(".git")
        and not Path(model).exists()
    )


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """Where ``huggingface_hub`` keeps its cache, read from the environment now."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model(
    model: Optional[Union[str, Path]],
    *,
    revision: Optional[str] = None,
    cache_dir: Optional[Union[str, Path]] = None,
    need_weights: bool = True,
    what: str = "model",
) -> Optional[Union[str, Path]]:
    """``model`` itself, or the local snapshot folder of the hub id ``model`` (see the module
    docstring). ``need_weights=False`` accepts a cached snapshot without weights files.
    ``what="tokenizer"``: a tokenizer repository (tokenizer.json needed, no config.json
    nor weights); messages name the argument ``what``."""
    if model is None or not looks_like_hub_id(model):
        return model
    assert isinstance(model, str)
    try:
        import huggingface_hub
    except ImportError:
        raise ModelLoadError(
            f"{what} {model!r} is not a local folder; to load it from the Hugging Face hub, install "
            "huggingface_hub (pip install huggingface_hub), or pass a checkpoint folder"
        ) from None
    cache = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    where = f"{what} {model!r}" + (f" (revision {revision!r})" if revision else "")
    required = "tokenizer.json" if what == "tokenizer" else "config.json"
    need_weights = need_weights and what == "model"

    cached = _cached_snapshot(huggingface_hub, model, revision, cache)
    if cached is not None and _complete(cached, need_weights, required):
        return cached
    if hub_offline():
        found = "an incomplete snapshot" if cached is not None else "nothing"
        raise ModelLoadError(
            f"{where} is not a local folder, and the Hugging Face cache {cache} holds {found} for it; "
            "HF_HUB_OFFLINE=1 forbids downloading it (unset HF_HUB_OFFLINE, or download it first)"
        )
    return _download(huggingface_hub, model, revision, cache, where, need_weights, required)


def _cached_snapshot(hub, model: str, revision: Optional[str], cache: Path) -> Optional[Path]:
    try:
        folder = hub.snapshot_download(model, revision=revision, cache_dir=str(cache), local_files_only=True)
    except Exception:  # LocalEntryNotFoundError, IncompleteSnapshotError, ...: not (all) cached
        return None
    return Path(folder)


def _complete(folder: Path, need_weights: bool, required: str = "config.json") -> bool:
    if not (folder / required).is_file():
        return False
    if not need_weights:
        return True
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def _download(hub, model: str, revision: Optional[str], cache: Path, where: str, need_weights: bool,
              required: str = "config.json") -> Path:
    from huggingface_hub import errors

    try:
        files = hub.HfApi().list_repo_files(model, revision=revision)
        wanted = _files_to_download(files, need_weights)
        folder = Path(hub.snapshot_download(model, revision=revision, cache_dir=str(cache), allow_patterns=wanted))
    except errors.RevisionNotFoundError as error:
        raise ModelLoadError(f"{where}: the Hugging Face hub has no such revision ({_line(error)})") from error
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as error:
        raise ModelLoadError(
            f"{where} is not a local folder and the Hugging Face hub has no repository by that name that "
            f"this machine may read (private or gated? log in with `hf auth login` or set HF_TOKEN) ({_line(error)})"
        ) from error
    except Exception as error:  # connection errors, HTTP errors, disk errors
        raise ModelLoadError(
            f"{where} is not a local folder nor in the Hugging Face cache {cache}, and downloading it "
            f"failed: {type(error).__name__}: {_line(error)}"
        ) from error
    if not _complete(folder, need_weights, required):
        missing = required if not (folder / required).is_file() else "weights (*.safetensors / *.bin)"
        raise ModelLoadError(
            f"{where}: the Hugging Face snapshot {folder} has no {missing}; it is not a "
            f"{'tokenizer' if required == 'tokenizer.json' else 'checkpoint'} pyengine can load"
        )
    return folder


def _files_to_download(files: list[str], need_weights: bool) -> list[str]:
    top = [name for name in files if "/" not in name]
    wanted = [name for name in top if _SIDE_FILES.fullmatch(name)]
    if need_weights:
        safetensors = [n for n in top if n.endswith(".safetensors") or n == "model.safetensors.index.json"]
        bins = [n for n in top if n.startswith("pytorch_model") and (n.endswith(".bin") or n.endswith(".bin.index.json"))]
        wanted += safetensors or bins
    return wanted


def _line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
