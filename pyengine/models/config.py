"""Parse a Hugging Face ``config.json`` into the one config our decoder models read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pyengine.models.deepseek_config import (
    DEEPSEEK_ARCHITECTURES,
    DeepseekMoeConfig,
    MlaConfig,
    parse_deepseek_moe,
    parse_mla,
    refuse_deepseek_extras,
)
from pyengine.models.errors import UnsupportedModelError
from pyengine.models.layer_config import gemma3_rope_parts, gemma_fields, layer_windows
from pyengine.models.moe_config import MoeConfig, parse_moe_config

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` "default", "linear", "llama3", "yarn" or
    "longrope"; the yarn fields are read by ``models/rope_yarn.py``; longrope is Phi-3's
    per-frequency ``short_factor`` / ``long_factor``, the long ones for sequences past
    ``original_max_position_embeddings``, cos/sin times ``attention_factor``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Shape and flavour of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # DeepSeek-V2 / V3 (``deepseek_config``): latent attention, and experts when any layer has them.
    mla: Optional[MlaConfig] = None
    deepseek_moe: Optional[DeepseekMoeConfig] = None
    moe: Optional[MoeConfig] = None  # mixture-of-experts fields (moe_config.py); None: dense
    # Sliding window of each layer (None: whole context); () when no layer has one.
    layer_windows: tuple[Optional[int], ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh" (Gemma)
    attention_scale: Optional[float] = None  # None: head_dim ** -0.5
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    local_rope: Optional[RopeConfig] = None  # Gemma 3's sliding layers' own rotary base

    def layer_window(self, layer_index: int) -> Optional[int]:
        """The sliding window of layer ``layer_index`` (None: it sees the whole context)."""
        return self.layer_windows[layer_index] if self.layer_windows else None

    @property
    def model_type(self) -> str:
        """Lower-case family name used in messages."""
        return self.architecture.removesuffix("ForCausalLM").lower()


_ARCH_FLAVOURS = {
    # architecture: (qkv_bias default, qk_norm)
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "DeepseekV2ForCausalLM": (False, False),
    "DeepseekV3ForCausalLM": (False, False),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "Gemma2ForCausalLM": (False, False),
    "Gemma3ForCausalLM": (False, True),
    "Phi3ForCausalLM": (False, False),
}
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    """Architecture names (``config.json: architectures``) this engine can run."""
    return tuple(_ARCH_FLAVOURS)


def parse_decoder_config(raw: dict[str, Any]) -> DecoderConfig:
    """Validate a config.json dict and turn it into a :class:`DecoderConfig`.

    Raises :class:`UnsupportedModelError` naming the offending field for anything the
    models do not implement (another architecture, an unknown layer kind or rope type,
    another activation, biases other than Qwen2's qkv bias).
    """
    architecture = _architecture(raw)
    if architecture in DEEPSEEK_ARCHITECTURES:  # num_key_value_heads means nothing under MLA
        _refuse_unsupported_features(raw, architecture, int(raw.get("max_position_embeddings") or 2048))
        refuse_deepseek_extras(raw, architecture)
        return _deepseek_config(raw, architecture)
    qkv_bias_default, qk_norm = _ARCH_FLAVOURS[architecture]
    hidden_size = _required_int(raw, "hidden_size")
    num_heads = _required_int(raw, "num_attention_heads")
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    if num_heads % num_kv_heads != 0:
        raise UnsupportedModelError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    max_positions = int(raw.get("max_position_embeddings") or 2048)
    _refuse_unsupported_features(raw, architecture, max_positions)
    if architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and raw.get("attention_bias"):
        # Llama/Mistral put the bias on o_proj as well, which the layers do not implement.
        raise UnsupportedModelError(f"attention_bias: true is not supported for {architecture}")
    qkv_bias = bool(raw.get("qkv_bias", True)) if architecture == "Qwen2MoeForCausalLM" else qkv_bias_default
    num_layers = _required_int(raw, "num_hidden_layers")
    rope, local_rope = _rope_configs(raw, architecture)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return DecoderConfig(
        architecture=architecture,
        vocab_size=_required_int(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_required_int(raw, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        rope=rope,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        moe=parse_moe_config(raw, architecture, num_layers),
        layer_windows=layer_windows(raw, architecture, num_layers),
        local_rope=local_rope,
        **gemma_fields(raw, architecture),
    )


def _deepseek_config(raw: dict[str, Any], architecture: str) -> DecoderConfig:
    """DeepSeek-V2 / V3: one latent "head" per token in the cache, ``head_dim`` the rotary
    part's width (what the rope tables span), as transformers sets it."""
    rope = _rope_config(raw)
    num_heads = _required_int(raw, "num_attention_heads")
    num_layers = _required_int(raw, "num_hidden_layers")
    mla = parse_mla(raw, architecture, rope)
    eos = raw.get("eos_token_id")
    return DecoderConfig(
        architecture=architecture,
        vocab_size=_required_int(raw, "vocab_size"),
        hidden_size=_required_int(raw, "hidden_size"),
        intermediate_size=_required_int(raw, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=mla.qk_rope_head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
        rope=rope,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        mla=mla,
        deepseek_moe=parse_deepseek_moe(raw, architecture, num_layers),
    )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if architectures:
        name = architectures[0]
        if name not in _ARCH_FLAVOURS:
            raise UnsupportedModelError(
                f"architectures: {name!r} is not supported (supported: {', '.join(_ARCH_FLAVOURS)})"
            )
        return name
    model_type = raw.get("model_type")
    if model_type not in _MODEL_TYPE_TO_ARCH:
        raise UnsupportedModelError(
            f"model_type: {model_type!r} is not supported (supported: {', '.join(_MODEL_TYPE_TO_ARCH)})"
        )
    return _MODEL_TYPE_TO_ARCH[model_type]


def _required_int(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(f"{name} must be a positive integer, got {value!r}")
    return value


def _refuse_unsupported_features(raw: dict[str, Any], architecture: str, max_positions: int) -> None:
    activation = raw.get("hidden_act", "silu")
    if activation != "silu" and architecture not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        raise UnsupportedModelError(f"hidden_act: {activation!r} is not supported (only 'silu')")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias: true is not supported")
    # Sliding windows (layer_config.layer_windows) are run; unknown layer kinds refused there.


def _rope_configs(raw: dict[str, Any], architecture: str) -> tuple[RopeConfig, Optional[RopeConfig]]:
    """The rotary parameters of the (global) layers, and Gemma 3's local layers' own."""
    if architecture != "Gemma3ForCausalLM":
        return _rope_config(raw), None
    full, local = gemma3_rope_parts(raw)
    return _rope_config(raw, full), _rope_config(raw, local)


def _rope_config(raw: dict[str, Any], params: Optional[dict[str, Any]] = None) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints write
    # `rope_theta` and an optional `rope_scaling`.
    if params is None:
        params = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or {}
        merged = {**scaling, **params}
    else:
        merged = dict(params)
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_scaling.rope_type: {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if raw.get("partial_rotary_factor", 1.0) != 1.0 or merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor: only 1.0 is supported")
    if rope_type == "yarn":
        return yarn_rope_config(merged, theta, int(raw.get("max_position_embeddings") or 2048))
    if rope_type == "longrope":
        return _longrope_config(raw, merged, theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def yarn_rope_config(merged: dict[str, Any], theta: float, max_positions: int) -> RopeConfig:
    """YaRN's fields as transformers reads them: the original context defaults to
    ``max_position_embeddings`` and a missing ``factor`` is their ratio."""
    original = int(merged.get("original_max_position_embeddings") or max_positions)
    factor = merged.get("factor")

    def optional(name: str) -> Optional[float]:
        value = merged.get(name)
        return None if value is None else float(value)

    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=float(factor) if factor is not None else max_positions / original,
        original_max_position_embeddings=original,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
    )


def _longrope_config(raw: dict[str, Any], merged: dict[str, Any], theta: float) -> RopeConfig:
    """Phi-3's longrope, with transformers' defaults: ``factor`` = max / original positions,
    ``attention_factor`` = sqrt(1 + ln(factor) / ln(original)) when the factor exceeds 1."""
    import math

    original = merged.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if not isinstance(original, int) or original <= 0:
        raise UnsupportedModelError(
            f"rope_scaling.original_max_position_embeddings must be a positive integer for longrope, got {original!r}"
        )
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = merged.get(name)
        if not isinstance(values, list) or not all(isinstance(x, (int, float)) for x in values):
            raise UnsupportedModelError(f"rope_scaling.{name} must be a list of numbers for longrope, got {values!r}")
        factors[name] = tuple(float(x) for x in values)
    factor = merged.get("factor") or int(raw.get("max_position_embeddings") or 2048) / original
    attention_factor = merged.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta=theta,
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
        attention_factor=float(attention_factor),
    )
