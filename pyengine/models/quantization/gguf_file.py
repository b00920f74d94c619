"""A GGUF file (llama.cpp's one-file checkpoint) read as a Hugging Face checkpoint: the
model's config.json from the file's metadata, its tensors under Hugging Face names, and
its tokenizer from the ``tokenizer.ggml.*`` metadata (built by transformers, as
``AutoTokenizer.from_pretrained(..., gguf_file=...)`` does).

The architectures read are the Llama-family ones pyengine runs: GGUF's ``llama`` (Llama,
Mistral), ``qwen2`` and ``qwen3``. llama.cpp's converter stores a Llama's q/k projection
rows interleaved per head (rotary pairs side by side); they are put back in Hugging Face
order here (``hf_row_order``). The file is memory-mapped (``gguf.GGUFReader``): a tensor's
bytes are read when it is converted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from pyengine.models.errors import ModelLoadError, UnsupportedModelError

GGUF_SUFFIX = ".gguf"
_MAGIC = b"GGUF"
#: GGUF general.architecture -> Hugging Face architecture.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: llama.cpp's per-layer tensor names (after "blk.N.") -> Hugging Face's (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf_file(path: Union[str, Path]) -> bool:
    """Whether ``path`` names a GGUF file (an existing file ending in .gguf)."""
    candidate = Path(path).expanduser()
    return candidate.suffix.lower() == GGUF_SUFFIX and candidate.is_file()


def hf_tensor_name(name: str) -> Optional[str]:
    """The Hugging Face name of a llama.cpp tensor name (None: not one pyengine maps)."""
    stem, dot, kind = name.rpartition(".")
    if not dot:
        return None
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{kind}"
    return None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: llama.cpp's name, GGML type name, row-major shape, bytes."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFCheckpoint:
    """The metadata and tensors of one GGUF file (memory-mapped)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path).expanduser()
        try:
            with open(self.path, "rb") as handle:
                magic = handle.read(4)
        except OSError as error:
            raise ModelLoadError(f"{self.path}: cannot be read ({error.strerror or error})") from error
        if magic != _MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (it does not start with 'GGUF')")
        try:
            import gguf
        except ImportError:
            raise ModelLoadError("reading GGUF files needs the gguf package: pip install 'pyengine[quant]'") from None
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as error:  # ValueError, struct errors on a truncated file
            raise ModelLoadError(f"{self.path}: cannot be read as GGUF; truncated or corrupt? ({error})") from error
        self.arch = str(self.field("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (strings decoded, arrays as lists), ``default`` when absent."""
        found = self._reader.fields.get(key)
        return default if found is None else found.contents()

    def tensors(self) -> dict[str, GGUFTensor]:
        """llama.cpp name -> tensor, in the file's order."""
        return {
            t.name: GGUFTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
            for t in self._reader.tensors
        }

    def config_dict(self) -> dict[str, Any]:
        """A config.json for the model in the file (what ``parse_decoder_config`` reads)."""
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path.name}: GGUF architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        if "rope_freqs.weight" in {t.name for t in self._reader.tensors}:
            raise UnsupportedModelError(
                f"{self.path.name}: per-frequency rope factors (rope_freqs.weight, Llama 3.1's rope scaling as "
                "llama.cpp stores it) are not supported in GGUF files; load the Hugging Face checkpoint instead"
            )
        a = self.arch
        heads = self._int(f"{a}.attention.head_count")
        hidden = self._int(f"{a}.embedding_length")
        embedding = self._embedding_shape()
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[a]],
            "model_type": a,
            "hidden_size": hidden,
            "intermediate_size": self._int(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._int(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._int(f"{a}.attention.head_count_kv", heads),
            "head_dim": self._int(f"{a}.attention.key_length", hidden // heads),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": self._int(f"{a}.context_length", 2048),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "vocab_size": embedding[0],
            "tie_word_embeddings": "output.weight" not in {t.name for t in self._reader.tensors},
            "hidden_act": "silu",
        }
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = {"rope_type": scaling, "factor": float(self.field(f"{a}.rope.scaling.factor", 1.0))}
        window = self.field(f"{a}.attention.sliding_window")
        if window:
            config["sliding_window"] = int(window)
            config["use_sliding_window"] = True
        for key, target in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
            if self.field(key) is not None:
                config[target] = int(self.field(key))
        return config

    def hf_row_order(self, hf_name: str, rows: int, config: dict[str, Any]) -> Optional[np.ndarray]:
        """The row order that puts a Llama q/k projection back in Hugging Face order
        (``tensor[order]``); None for every other tensor."""
        if self.arch != "llama" or not hf_name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                          "self_attn.q_proj.bias", "self_attn.k_proj.bias")):
            return None
        heads = config["num_attention_heads"] if ".q_proj." in hf_name else config["num_key_value_heads"]
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)

    def _embedding_shape(self) -> tuple[int, ...]:
        for t in self._reader.tensors:
            if t.name == "token_embd.weight":
                return tuple(int(d) for d in reversed(t.shape.tolist()))
        raise ModelLoadError(f"{self.path.name}: no token_embd.weight tensor")

    def _int(self, key: str, default: Optional[int] = None) -> int:
        value = self.field(key, default)
        if value is None:
            raise ModelLoadError(f"{self.path.name}: GGUF metadata {key} is missing")
        return int(value)


def gguf_tokenizer(checkpoint: GGUFCheckpoint) -> tuple[Optional[Any], dict[str, Any]]:
    """The file's tokenizer (``tokenizers.Tokenizer``, built by transformers from the
    ``tokenizer.ggml.*`` metadata) and a tokenizer_config with its special tokens and chat
    template; (None, {}) when the file carries no tokenizer."""
    if checkpoint.field("tokenizer.ggml.model") is None:
        return None, {}
    from transformers import AutoTokenizer

    path = checkpoint.path
    try:
        built = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as error:  # transformers' converters raise ValueError, KeyError...
        raise ModelLoadError(
            f"{path.name}: transformers cannot build a tokenizer from its metadata ({error}); "
            "pass tokenizer= a Hugging Face tokenizer folder"
        ) from error
    tokenizer_config: dict[str, Any] = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(built, name, None)
        if value is not None:
            tokenizer_config[name] = str(value)
    template = checkpoint.field("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    return built.backend_tokenizer, tokenizer_config
