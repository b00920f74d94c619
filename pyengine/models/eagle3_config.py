"""An EAGLE-3 head's config.json, as its authors publish it, checked against the target.

The EAGLE authors' heads (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`` and those trained the same
way) ship a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]`` (vLLM also
names it ``Eagle3LlamaForCausalLM``), one hidden layer, the target's ``hidden_size`` and
``vocab_size``, and ``draft_vocab_size``: the head's own, smaller output vocabulary, mapped
to the target's ids by the checkpoint's ``d2t`` tensor. The target layers it reads
(``eagle_aux_hidden_state_layer_ids``, at the top level or in ``eagle_config``) default to
vLLM's choice for a Llama target of ``n`` layers, ``(2, n // 2, n - 3)``; layer ``i``'s
state is the residual stream entering it (0: the embeddings). ``norm_before_residual``
(default false) says whether the head's residual is its input hidden state before or
after ``hidden_norm``. What this engine does not run is refused by name
(``InvalidConfigError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyengine.errors import InvalidConfigError
from pyengine.models.config import DecoderConfig, parse_decoder_config
from pyengine.models.loader import read_json

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
#: EAGLE-3 reads three target layers (its ``fc`` is [hidden, 3 * hidden]).
NUM_AUX_LAYERS = 3
_LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Eagle3HeadConfig:
    """The head's shape (``layer``: its one Llama layer, the target's vocabulary) and what
    it reads of the target."""

    layer: DecoderConfig
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # ascending target layer indices
    norm_before_residual: bool


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default layers for a Llama target: early, middle and late."""
    n = num_target_layers
    return (2, n // 2, n - 3)


def read_eagle3_config(folder: Path, target: DecoderConfig) -> Eagle3HeadConfig:
    """The head's config.json in ``folder``, checked against the ``target`` it drafts for."""
    raw = read_json(folder / "config.json")

    def bad(field: str, requirement: str) -> InvalidConfigError:
        return InvalidConfigError(f"speculative_config: the EAGLE-3 head's {field} {requirement} ({folder})")

    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or not architectures or architectures[0] not in EAGLE3_ARCHITECTURES:
        raise bad("architectures", f"must be one of {list(EAGLE3_ARCHITECTURES)}, got {architectures!r}")
    if target.mla is not None:
        raise InvalidConfigError("speculative_config: method 'eagle3' with a latent-attention target (DeepSeek MLA) "
                                 "is not supported")
    eagle_config = raw.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise bad("eagle_config", f"must be an object, got {eagle_config!r}")
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        raise bad("eagle_config.use_aux_hidden_state", "must be true (a head without auxiliary hidden states is "
                  "EAGLE-1/2, not supported)")
    if raw.get("num_hidden_layers") != 1:
        raise bad("num_hidden_layers", f"must be 1, got {raw.get('num_hidden_layers')!r}")
    for field, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if raw.get(field) != want:
            raise bad(field, f"must be the target's ({want}), got {raw.get(field)!r}")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != target.hidden_size:
        raise bad("target_hidden_size", f"must be the target's hidden_size ({target.hidden_size}), got "
                  f"{target_hidden!r}")
    draft_vocab = raw.get("draft_vocab_size")
    draft_vocab = target.vocab_size if draft_vocab is None else draft_vocab
    if not _is_int(draft_vocab) or not 1 <= draft_vocab <= target.vocab_size:
        raise bad("draft_vocab_size", f"must be an integer from 1 to vocab_size ({target.vocab_size}), got "
                  f"{draft_vocab!r}")
    layer_raw: dict[str, Any] = {**raw, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False}
    return Eagle3HeadConfig(
        layer=parse_decoder_config(layer_raw),
        draft_vocab_size=int(draft_vocab),
        aux_layer_ids=_aux_layers(raw, eagle_config, target.num_hidden_layers, bad),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


def _aux_layers(raw: dict[str, Any], eagle_config: dict[str, Any], num_layers: int, bad: Any) -> tuple[int, ...]:
    ids = raw.get(_LAYER_IDS_KEY)
    field = _LAYER_IDS_KEY
    if ids is None and eagle_config.get(_LAYER_IDS_KEY) is not None:
        ids, field = eagle_config[_LAYER_IDS_KEY], f"eagle_config.{_LAYER_IDS_KEY}"
    if ids is None:
        ids, field = default_aux_layers(num_layers), f"{_LAYER_IDS_KEY} (default (2, n // 2, n - 3))"
    if (not isinstance(ids, (list, tuple)) or len(ids) != NUM_AUX_LAYERS or not all(_is_int(i) for i in ids)
            or len(set(ids)) != NUM_AUX_LAYERS or not all(0 <= i < num_layers for i in ids)):
        raise bad(field, f"must be {NUM_AUX_LAYERS} distinct layer indices of the target, 0 to {num_layers - 1}, "
                  f"got {list(ids) if isinstance(ids, (list, tuple)) else ids!r}")
    return tuple(sorted(int(i) for i in ids))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
