"""The per-layer and per-family parts of a ``config.json``: which layers attend through a
sliding window, and Gemma's attention scale, soft-caps, activation and local rotary base.

Each family spells its sliding window its own way; transformers 5 resolves them all into
``layer_types`` ("sliding_attention" / "full_attention") plus one ``sliding_window``, and
writes ``layer_types`` into the configs it saves. Published configs are older and often
carry only the family's own fields, so both are read here, with transformers' defaults:

- Mistral, Mixtral, Phi-3: ``sliding_window`` (null: none) applies to every layer; Mistral
  ignores ``layer_types`` as transformers does.
- Qwen2, Qwen3 (and their MoE): the window counts only with ``use_sliding_window: true``, and then on
  layers ``i >= max_window_layers`` (or as ``layer_types`` says).
- Gemma 2: ``layer_types``, else every even layer (0, 2, ...) is a sliding one.
- Gemma 3: ``layer_types``, else ``sliding_window_pattern`` (6): layer ``i`` is sliding
  unless ``(i + 1) % pattern == 0``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pyengine.models.errors import UnsupportedModelError

_LAYER_TYPES = ("full_attention", "sliding_attention")
_QWEN_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)


def layer_windows(raw: dict[str, Any], architecture: str, num_layers: int) -> tuple[Optional[int], ...]:
    """The sliding window of every layer (None: the whole context); () when no layer has one."""
    window = raw.get("sliding_window")
    if architecture == "LlamaForCausalLM":  # transformers' Llama has no sliding window
        window = None
    if architecture in _QWEN_WINDOWS and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise UnsupportedModelError(f"sliding_window must be a positive integer or null, got {window!r}")
    sliding = _sliding_layers(raw, architecture, num_layers)
    windows = tuple(window if is_sliding else None for is_sliding in sliding)
    return windows if any(w is not None for w in windows) else ()


def kv_groups(layer_windows: tuple[Optional[int], ...], num_layers: int) -> list[tuple[Optional[int], int]]:
    """The layers grouped by attention need, as the scheduler takes them: ``(window, layers)``
    per distinct window (None: the whole context), in order of first appearance. With every
    group windowed the scheduler frees blocks behind the widest window while a sequence runs;
    one full group keeps every block (``docs/architecture.md``, KV blocks)."""
    if not layer_windows:
        return [(None, num_layers)]
    counts: dict[Optional[int], int] = {}
    for window in layer_windows:
        counts[window] = counts.get(window, 0) + 1
    return list(counts.items())


def _sliding_layers(raw: dict[str, Any], architecture: str, num_layers: int) -> list[bool]:
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return [True] * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return [kind == "sliding_attention" for kind in checked_layer_types(layer_types, num_layers)]
    pattern: Callable[[int], bool]
    if architecture == "Gemma2ForCausalLM":
        pattern = lambda i: (i + 1) % 2 != 0  # noqa: E731 - transformers' rule, as written there
    elif architecture == "Gemma3ForCausalLM":
        every = raw.get("sliding_window_pattern", 6)
        if not isinstance(every, int) or every <= 0:
            raise UnsupportedModelError(f"sliding_window_pattern must be a positive integer, got {every!r}")
        pattern = lambda i: (i + 1) % every != 0  # noqa: E731
    else:  # Qwen2 / Qwen3 and their MoE
        first = int(raw.get("max_window_layers", 28))
        pattern = lambda i: i >= first  # noqa: E731
    return [pattern(i) for i in range(num_layers)]


def checked_layer_types(layer_types: Any, num_layers: int) -> list[str]:
    """``layer_types`` when it names one known kind per layer, else an error naming it."""
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise UnsupportedModelError(
            f"layer_types must list one kind per layer ({num_layers}), got {layer_types!r}"
        )
    unknown = sorted({kind for kind in layer_types if kind not in _LAYER_TYPES})
    if unknown:
        raise UnsupportedModelError(
            f"layer_types: {unknown} are not supported (supported: {', '.join(_LAYER_TYPES)})"
        )
    return layer_types


def gemma_fields(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Gemma 2 / 3's extra decoder fields (none for the other families): the attention
    scale from ``query_pre_attn_scalar``, the attention and final logit soft-caps, and the
    MLP activation; the refusals name what pyengine does not run."""
    if architecture not in GEMMA_ARCHITECTURES:
        return {}
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in GEMMA_ACTIVATIONS:
        raise UnsupportedModelError(
            f"hidden_activation: {activation!r} is not supported (only {', '.join(GEMMA_ACTIVATIONS)})"
        )
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention: true is not supported (causal decoders only)")
    scalar = raw.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise UnsupportedModelError(f"query_pre_attn_scalar must be a positive number, got {scalar!r}")
    return dict(
        hidden_act=activation,
        attention_scale=float(scalar) ** -0.5,
        attn_logit_softcap=_softcap(raw, "attn_logit_softcapping"),
        final_logit_softcap=_softcap(raw, "final_logit_softcapping"),
    )


def _softcap(raw: dict[str, Any], name: str) -> Optional[float]:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise UnsupportedModelError(f"{name} must be a positive number or null, got {value!r}")
    return float(value)


def gemma3_rope_parts(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope parameters of a Gemma 3 config as flat dicts ``_rope_config``
    reads: transformers 5's ``rope_parameters`` keyed by layer type, or the published
    ``rope_theta`` (1e6) + ``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` (1e4) for the local ones."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_theta": 1_000_000.0, **(params.get("full_attention") or {})}
        local = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
        return full, local
    full = {**(raw.get("rope_scaling") or {}), **params}
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local = {"rope_theta": float(raw.get("rope_local_base_freq", 10_000.0)), "rope_type": "default"}
    return full, local
