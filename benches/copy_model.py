"""A small Llama checkpoint that copies its context, its weights set by hand.

Speculative decoding's drafts-right workload needs a model that, seeing a span again,
continues it as it did before (what trained models do on summaries, code edits and
agent loops, and what prompt lookup bets on). A random-weight model does not, no trained
model is reachable from this machine, and training one on a shared 2-core CPU took too
long to form an induction head. So this writes one whose two layers *are* an induction
circuit, in the real Llama architecture (saved by transformers, loaded by pyengine's
loader, run by its executor; RoPE, RMSNorm, GQA-free attention, an MLP set to zero):

- the embedding puts a unit vector ``r_t`` per token in the "token" subspace and a
  constant 1 in one more dimension;
- layer 0, two position heads: from the constant dimension alone (so whatever the
  tokens) their queries and keys are set, rotary pair by pair, to the phase that makes
  the score peak at a distance of 1 (head 0) and 2 (head 1) tokens back; their values
  copy that token's ``r`` into the "previous" and "previous-but-one" subspaces;
- layer 1, an induction head: the query is the current token and its predecessor
  (``r_t``, ``r_prev``), the key at each position its two predecessors, both in rotary
  pairs whose frequency is below 1e-3 (RoPE leaves them almost unrotated over the
  context), so the score peaks where the last two tokens occurred before; the value
  copies the token found there into the "next" subspace;
- the head reads the "next" subspace: the logits peak at the token that followed the
  latest earlier occurrence of the current bigram (of the current token when no bigram
  recurs).

So on X + G + X it continues with G, as prompt lookup guesses. Where the context holds
no earlier occurrence its prediction is arbitrary (an average of the values attended),
so on random prompts it behaves like the random-weight model. ``copy_accuracy``
measures the copying on fresh repeated spans through transformers' own forward.

The checkpoint is cached under ``~/.cache/pyengine/bench`` (``PYENGINE_BENCH_CACHE``)
in a folder named by a hash of its recipe; building it takes a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

#: Everything the checkpoint depends on; its hash names the cache folder.
COPY_RECIPE = dict(
    version=1,
    vocab_size=4096,
    token_dims=64,       # the size of each subspace holding a token's vector
    head_dim=256,        # 128 rotary pairs: 0..31 fast (position heads), 64..127 < 1e-3 rad/token
    rope_theta=1e6,
    position_gain=12.0,  # query and key norm of the position heads (sharpness)
    match_gain=14.0,     # query and key gain of the induction head
    seed=0,
)


def recipe_key(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("PYENGINE_BENCH_CACHE", Path.home() / ".cache" / "pyengine" / "bench"))


def _shape(recipe: dict) -> dict:
    d = recipe["token_dims"]
    return dict(config_class="LlamaConfig", hidden_size=4 * d + 64, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=recipe["head_dim"],
                tie_word_embeddings=False, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": recipe["rope_theta"]})


def copy_weights(recipe: dict) -> dict[str, torch.Tensor]:
    """The induction circuit's weights, by the Hugging Face Llama parameter names."""
    d, hd, vocab = recipe["token_dims"], recipe["head_dim"], recipe["vocab_size"]
    hidden = 4 * d + 64
    half = hd // 2
    tok, prev, prev2, nxt, const = slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d), slice(3 * d, 4 * d), 4 * d
    generator = torch.Generator().manual_seed(recipe["seed"])
    r = torch.randn(vocab, d, generator=generator)
    r = r / r.norm(dim=1, keepdim=True)

    w: dict[str, torch.Tensor] = {}
    embed = torch.zeros(vocab, hidden)
    embed[:, tok] = r
    embed[:, const] = 1.0
    w["model.embed_tokens.weight"] = embed
    # RMSNorm scales a vector with n unit-norm parts to norm sqrt(hidden / n) per part
    # (weights 1): layer 0 sees 2 parts (token, constant), layer 1 sees 3 (+ previous,
    # previous-but-one ~ 1 each: 4), the final norm 5.
    scale0, scale1 = math.sqrt(hidden / 2), math.sqrt(hidden / 4)

    # Layer 0: position heads. Rotary pair p holds head dims (p, p + half); a key of
    # (c, 0) and a query of c * e^{-i s theta_p} score c^2 cos((m - n - s) theta_p),
    # which summed over the fast pairs peaks at distance m - n = s.
    inv_freq = recipe["rope_theta"] ** (-torch.arange(half, dtype=torch.float64) * 2 / hd)
    fast = range(0, 32)
    c = recipe["position_gain"] / scale0
    q0 = torch.zeros(2 * hd, hidden)
    k0 = torch.zeros(2 * hd, hidden)
    v0 = torch.zeros(2 * hd, hidden)
    o0 = torch.zeros(hidden, 2 * hd)
    for head, shift in ((0, 1), (1, 2)):
        base = head * hd
        for p in fast:
            angle = -shift * float(inv_freq[p])
            q0[base + p, const] = c * math.cos(angle)
            q0[base + p + half, const] = c * math.sin(angle)
            k0[base + p, const] = c
        v0[base:base + d, tok] = torch.eye(d) / scale0  # the attended token's r, unscaled
    o0[prev, 0:d] = torch.eye(d)
    o0[prev2, hd:hd + d] = torch.eye(d)

    # Layer 1: induction head 0 in the slow pairs 64..127 (head dims 64..127 and
    # 192..255), which rotate by under 1e-3 rad per token: q = g (r_t, r_prev),
    # k = g (prev_j, prev2_j), so q.k = g^2 (r_t . r_{j-1} + r_prev . r_{j-2}).
    slow_a, slow_b = slice(64, 128), slice(128 + 64, 256)
    g = recipe["match_gain"] / scale1
    q1 = torch.zeros(2 * hd, hidden)
    k1 = torch.zeros(2 * hd, hidden)
    v1 = torch.zeros(2 * hd, hidden)
    o1 = torch.zeros(hidden, 2 * hd)
    q1[slow_a, tok] = g * torch.eye(d)
    q1[slow_b, prev] = g * torch.eye(d)
    k1[slow_a, prev] = g * torch.eye(d)
    k1[slow_b, prev2] = g * torch.eye(d)
    v1[0:d, tok] = torch.eye(d) / scale1
    o1[nxt, 0:d] = torch.eye(d)

    for layer, (q, k, v, o) in enumerate(((q0, k0, v0, o0), (q1, k1, v1, o1))):
        prefix = f"model.layers.{layer}."
        w[prefix + "self_attn.q_proj.weight"] = q
        w[prefix + "self_attn.k_proj.weight"] = k
        w[prefix + "self_attn.v_proj.weight"] = v
        w[prefix + "self_attn.o_proj.weight"] = o
        w[prefix + "mlp.gate_proj.weight"] = torch.zeros(64, hidden)
        w[prefix + "mlp.up_proj.weight"] = torch.zeros(64, hidden)
        w[prefix + "mlp.down_proj.weight"] = torch.zeros(hidden, 64)
        w[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        w[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    w["model.norm.weight"] = torch.ones(hidden)
    head = torch.zeros(vocab, hidden)
    head[:, nxt] = 4.0 * r  # logits of a few units: a clear argmax, a soft distribution
    w["lm_head.weight"] = head
    return w


def write_copy_checkpoint(folder: Path, recipe: dict = COPY_RECIPE) -> Path:
    """Writes the checkpoint (config, tokenizer, safetensors) into ``folder``."""
    import transformers

    from pyengine.models.default_model import write_random_checkpoint

    write_random_checkpoint(folder, _shape(recipe), seed=recipe["seed"], vocab_size=recipe["vocab_size"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weights = copy_weights(recipe)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"copy model weights do not match Llama's: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(folder)
    return folder


def copy_checkpoint(root: Optional[Path] = None, recipe: dict = COPY_RECIPE) -> Path:
    """The checkpoint's folder, written on first use. Written into a staging folder and
    renamed into place, so a concurrent or interrupted build never leaves a half-written
    checkpoint where a later run would reuse it."""
    root = Path(root) if root is not None else cache_root()
    target = root / f"copy-llama-{recipe_key(recipe)}"
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".copy-llama-", dir=root))
    try:
        write_copy_checkpoint(staging, recipe)
        (staging / "recipe.json").write_text(json.dumps(recipe, indent=2))
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@torch.no_grad()
def copy_accuracy(folder: Path, vocab_size: int, rows: int = 8, span: int = 48, seed: int = 12345) -> float:
    """Share of the second occurrence's tokens of a random span (after a random prefix)
    that transformers' forward of the checkpoint predicts greedily."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab_size, (rows, 64), generator=generator)
    x = torch.randint(0, vocab_size, (rows, span), generator=generator)
    ids = torch.cat([prefix, x, x], dim=1)
    predicted = model(input_ids=ids).logits.argmax(-1)
    second = slice(64 + span, 64 + 2 * span - 1)  # position p predicts p + 1
    return float((predicted[:, second] == ids[:, 64 + span + 1:]).float().mean())


if __name__ == "__main__":
    folder = copy_checkpoint()
    print(json.dumps({"folder": str(folder),
                      "copy_accuracy": round(copy_accuracy(folder, COPY_RECIPE["vocab_size"]), 4)}), file=sys.stdout)
