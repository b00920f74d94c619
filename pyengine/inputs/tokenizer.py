"""The Hugging Face tokenizer ``LLM.get_tokenizer()`` returns, as vLLM's does.

The engine itself tokenizes with the raw ``tokenizers.Tokenizer`` (the loader's); scripts
ported from vLLM expect a transformers tokenizer (``apply_chat_template``,
``eos_token_id``, ``encode`` / ``decode`` on lists). This builds a
``PreTrainedTokenizerFast`` from the same files, tokenizer.json and tokenizer_config.json,
so both agree on every id. It is a plain fast tokenizer whatever ``tokenizer_class`` the
config names: no model-specific Python class and never remote code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union


def hf_tokenizer(folder: Optional[Union[str, Path]], tokenizer: Optional[Any] = None,
                 tokenizer_config: Optional[dict[str, Any]] = None) -> Optional[Any]:
    """A ``transformers.PreTrainedTokenizerFast`` for the checkpoint ``folder`` (read from
    its tokenizer.json / tokenizer_config.json / chat_template.jinja); without such a
    folder, one wrapping ``tokenizer`` (a ``tokenizers.Tokenizer``) with the special
    tokens and chat template of ``tokenizer_config``. None when there is no tokenizer."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:  # pragma: no cover - transformers comes with the torch extra
        raise ImportError("LLM.get_tokenizer() needs transformers: pip install 'pyengine[torch]'") from error
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    if tokenizer is None:
        return None
    from tokenizers import Tokenizer

    config = tokenizer_config or {}
    kwargs: dict[str, Any] = {
        name: _token_text(config[name])
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if config.get(name) is not None
    }
    if config.get("chat_template") is not None:
        kwargs["chat_template"] = config["chat_template"]
    # A copy: the engine's tokenizer is shared with its threads and must not be reconfigured.
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()), **kwargs)


def _token_text(token: Any) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        return str(token.get("content", ""))
    return str(token)
