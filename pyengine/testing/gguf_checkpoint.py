"""Write a Hugging Face checkpoint folder as a GGUF file, as llama.cpp's converter lays it
out, for tests and benches (no model hub is reachable, and llama.cpp's converter is not a
library): ``gguf.GGUFWriter`` writes the file, ``gguf.quants`` the Q8_0 / Q4_0 / F16 /
BF16 blocks, :mod:`pyengine.testing.kquants` the Q4_K / Q6_K ones.

The layout follows ``convert_hf_to_gguf.py``: llama.cpp's tensor names, the rows of a
Llama ``q_proj`` / ``k_proj`` interleaved per head (its rotary pairs neighbouring values;
Qwen's are left as they are), norms and biases in float32, no ``output.weight`` when the
embedding is tied, and the byte-level BPE tokenizer as ``tokenizer.ggml.*`` metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import numpy as np
from safetensors.numpy import load_file

from pyengine.testing.kquants import quantize_q4_k, quantize_q6_k

#: Hugging Face model_type -> GGUF general.architecture.
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face tensor name."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    for hf, ours in _LAYER_NAMES.items():
        if rest == hf or rest.startswith(hf + "."):
            return f"blk.{index}.{ours}{rest[len(hf):]}"
    raise ValueError(f"no GGUF name for {hf_name}")


def write_gguf(
    folder: Union[str, Path],
    path: Union[str, Path],
    qtype: str = "Q8_0",
    *,
    types: Optional[dict[str, str]] = None,
    with_tokenizer: bool = True,
) -> Path:
    """``folder``'s checkpoint as a GGUF file at ``path``: every matrix in ``qtype`` (Q8_0,
    Q4_0, Q4_K, Q6_K, F16, BF16, F32), the 1-D tensors in F32. ``types`` overrides the
    type of single tensors by GGUF name (llama.cpp's Q4_K_M puts some in Q6_K, say)."""
    import gguf

    folder, path = Path(folder), Path(path)
    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    tensors = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, arch)
    if with_tokenizer:
        _write_tokenizer(writer, folder, config)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    for hf_name, tensor in tensors.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        name = gguf_name(hf_name)
        values = tensor.astype(np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            values = interleave_rotary_rows(values, heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            values = interleave_rotary_rows(values, kv_heads)
        kind = (types or {}).get(name, qtype if values.ndim == 2 else "F32")
        data, raw_type = encode(values, kind)
        writer.add_tensor(name, data, raw_dtype=raw_type)  # quantized bytes: the shape comes from them
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def interleave_rotary_rows(values: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for a Llama q/k projection: each head's two rotary halves
    interleaved (row i of the first half, then row i of the second)."""
    rows = values.shape[0]
    return values.reshape(heads, 2, rows // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def encode(values: np.ndarray, kind: str) -> tuple[np.ndarray, "object"]:
    """(bytes or floats, GGMLQuantizationType) of ``values`` in the GGML type ``kind``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return values.astype(np.float32), qtype
    if kind == "F16":
        return values.astype(np.float16), qtype
    if kind == "Q4_K":
        return quantize_q4_k(values), qtype
    if kind == "Q6_K":
        return quantize_q6_k(values), qtype
    return gguf.quants.quantize(values, qtype), qtype


def _write_metadata(writer, config: dict, arch: str) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(f"pyengine-test-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer, folder: Path, config: dict) -> None:
    """A byte-level BPE tokenizer.json as GGUF's "gpt2" tokenizer: tokens by id (padded
    to the model's vocabulary with unused tokens, as llama.cpp's converter does), merges,
    special ids, chat template."""
    raw = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(raw["model"]["vocab"])
    special = {t["content"]: t["id"] for t in raw.get("added_tokens", [])}
    vocab.update(special)
    by_id = {index: token for token, index in vocab.items()}
    size = config["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [3 if tok in special else (5 if i not in by_id else 1) for i, tok in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tokenizer_config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text()) if tokenizer_config_path.exists() else {}
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(int(config["bos_token_id"]))
    writer.add_add_bos_token(False)
    template = tokenizer_config.get("chat_template")
    if not template and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)
