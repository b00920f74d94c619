"""Random EAGLE-3 heads written in the layout their authors publish (``models/eagle3.py``),
for tests and benchmarks: a config.json like ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``'s
(``architectures: ["LlamaForCausalLMEagle3"]``, one layer, ``draft_vocab_size``) and a
``model.safetensors`` with ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``
and, when asked, ``embed_tokens``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch


def write_eagle3_head(
    path: Union[str, Path],
    target: Union[str, Path],
    *,
    seed: int = 0,
    draft_vocab_size: Optional[int] = None,
    aux_layer_ids: Optional[Sequence[int]] = None,
    own_embedding: bool = False,
    std: float = 0.1,
    bin_file: bool = False,
    **overrides: Any,
) -> Path:
    """A random head for the target checkpoint folder ``target`` into ``path``.

    ``draft_vocab_size`` below the target's writes a ``d2t`` mapping the draft ids onto a
    random subset of the target's vocabulary (sorted, as the authors' maps are);
    ``aux_layer_ids`` goes to ``eagle_aux_hidden_state_layer_ids`` (None: left out, the
    default layers apply); ``bin_file`` writes ``pytorch_model.bin`` (torch.save) as the
    authors' own heads ship, instead of safetensors; ``overrides`` replace config fields
    (e.g. to write a bad head).
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    raw = json.loads((Path(target) / "config.json").read_text())
    hidden, vocab = raw["hidden_size"], raw["vocab_size"]
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    inter = raw["intermediate_size"]
    draft_vocab = vocab if draft_vocab_size is None else draft_vocab_size
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "hidden_act": "silu",
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": raw.get("max_position_embeddings", 2048),
        "rope_theta": raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                                  "use_aux_hidden_state": True}
    config.update(overrides)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=generator)

    tensors = {
        "fc.weight": normal(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": normal(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": normal(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": normal(inter, hidden),
        "midlayer.mlp.up_proj.weight": normal(inter, hidden),
        "midlayer.mlp.down_proj.weight": normal(hidden, inter),
        "norm.weight": norm(),
        "lm_head.weight": normal(draft_vocab, hidden),
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = normal(vocab, hidden)
    if draft_vocab < vocab:
        chosen = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        tensors["d2t"] = chosen - torch.arange(draft_vocab)  # draft id i is target id i + d2t[i]
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        tensors["t2d"] = t2d
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if bin_file:
        torch.save(tensors, folder / "pytorch_model.bin")
        return folder
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"))
    return folder
