"""GGUF files (llama.cpp's format) loaded through the real loader, against transformers
loading the same file (``from_pretrained(..., gguf_file=...)``, which dequantizes every
tensor with the ``gguf`` package): prefill logits within float32 rounding of it (pyengine
multiplies by the same dequantized values; only the order of the float sums differs),
greedy tokens equal, and tensor parallel size 2 giving the logits of size 1.

The files are written by the test: tiny random checkpoints converted by
``pyengine.testing.gguf_checkpoint`` (the ``gguf`` package's writer and quantizers; Q4_K /
Q6_K blocks from ``pyengine.testing.kquants``, checked here against ``gguf``'s reader)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")

from pyengine import LLM, SamplingParams  # noqa: E402
from pyengine.errors import EngineError  # noqa: E402
from pyengine.executor.config import ExecutorConfig  # noqa: E402
from pyengine.executor.model_runner import ModelRunner  # noqa: E402
from pyengine.models.errors import ModelLoadError, UnsupportedModelError  # noqa: E402
from pyengine.models.loader import load_model  # noqa: E402
from pyengine.models.quantization.fill import merge_parts  # noqa: E402
from pyengine.models.quantization.gguf import convert_tensor  # noqa: E402
from pyengine.models.quantization.packed import PackedWeight, QuantizationError  # noqa: E402
from pyengine.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from pyengine.testing.gguf_checkpoint import encode, write_gguf  # noqa: E402
from pyengine.testing.hand_plan import HandPlanner  # noqa: E402
from pyengine.testing.kquants import quantize_q4_k, quantize_q6_k  # noqa: E402
from pyengine.testing.tp_ranks import check_two_ranks_match_one  # noqa: E402

# Input widths multiples of 256 (a K-quant super-block), per rank at TP=2 multiples of 32.
# head_dim 128: transformers reads no head_dim from a qwen3 GGUF file and takes Qwen3's default.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
ATOL, RTOL = 1e-4, 1e-4
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [8, 9, 10]]
# Q4_K_M-like: most matrices Q4_K, some Q6_K (mixed inside q/k/v), the head Q6_K.
Q4_K_M = {"blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "F16", "BF16"])
def test_each_type_converts_to_the_values_gguf_reads(kind):
    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    data, qtype = encode(weight, kind) if kind != "BF16" else (gguf.quants.quantize(weight, gguf.GGMLQuantizationType.BF16),
                                                               gguf.GGMLQuantizationType.BF16)
    ours = convert_tensor(kind, data, (6, 512), "w")
    reference = gguf.quants.dequantize(data, qtype) if kind not in ("F16",) else data.astype(np.float32)
    dense = ours.dequantize() if isinstance(ours, PackedWeight) else ours.float()
    np.testing.assert_array_equal(dense.numpy(), reference)
    expected = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_K": (4, 32), "Q6_K": (8, 16)}
    if kind in expected:
        assert (ours.bits, ours.group_size) == expected[kind]


def test_kquant_writers_stay_close_to_the_float_weight():
    """The test quantizers make sensible blocks (not only bytes gguf can read)."""
    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((4, 512)) * 0.05).astype(np.float32)
    for quantize, qtype, bound in ((quantize_q4_k, "Q4_K", 0.25), (quantize_q6_k, "Q6_K", 0.05)):
        back = gguf.quants.dequantize(quantize(weight), gguf.GGMLQuantizationType[qtype])
        assert np.abs(back - weight).max() < bound * np.abs(weight).max()


def test_mixed_parts_merge_exactly():
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((4, 256)).astype(np.float32) for _ in range(2))
    q4 = convert_tensor("Q4_K", quantize_q4_k(a), (4, 256), "a")
    q6 = convert_tensor("Q6_K", quantize_q6_k(b), (4, 256), "b")
    merged = merge_parts([q4, q6])
    assert isinstance(merged, PackedWeight) and (merged.bits, merged.group_size) == (8, 16)
    torch.testing.assert_close(merged.dequantize(), torch.cat([q4.dequantize(), q6.dequantize()]), atol=0, rtol=0)


def _transformers_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def _runner(path) -> ModelRunner:
    return ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64))


CASES = [
    ("qwen3", "Q8_0", True, None),
    ("qwen3", "Q4_K", False, Q4_K_M),
    ("llama", "Q4_0", False, None),
    ("llama", "Q6_K", True, None),
    ("qwen2", "F16", True, None),
    ("qwen2", "BF16", False, {"blk.0.attn_q.weight": "Q8_0"}),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{q}-{'tied' if t else 'untied'}" for a, q, t, _ in CASES])
def gguf_file(request, tmp_path_factory):
    arch, qtype, tied, types = request.param
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("hf"), arch, tie_word_embeddings=tied, **SHAPE)
    return write_gguf(folder, folder.parent / f"{arch}-{qtype}.gguf", qtype, types=types)


def test_prefill_logits_match_transformers_on_the_file(gguf_file):
    runner = _runner(gguf_file)
    prompt = list(range(3, 73))
    planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=8)
    planner.add(prompt)
    ours = runner.model.compute_logits(runner.execute(planner.next_plan(), return_hidden=True).hidden_states)
    with torch.no_grad():
        theirs = _transformers_model(gguf_file)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


def test_greedy_tokens_equal_transformers(gguf_file):
    reference = _transformers_model(gguf_file)
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = [reference.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
                  for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(model=str(gguf_file), max_model_len=256) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert ours == theirs


def test_quantized_weights_stay_packed(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "hf", "qwen3", tie_word_embeddings=True, **SHAPE)
    runner = _runner(write_gguf(folder, tmp_path / "m.gguf", "Q4_K", types=Q4_K_M))
    attention = runner.model.layers[0].self_attn
    assert attention.qkv_proj.quantized.weight.bits == 8  # Q4_K q/k merged with a Q6_K v
    assert runner.model.layers[1].self_attn.qkv_proj.quantized.weight.bits == 4
    assert runner.model.quantized_head is not None and runner.model.lm_head is None


def test_text_uses_the_files_tokenizer_or_the_one_given(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "hf", "qwen3", tie_word_embeddings=True, **SHAPE)
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    bare = write_gguf(folder, tmp_path / "bare.gguf", "Q8_0", with_tokenizer=False)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = "def generate(prompt):"
    with LLM(model=str(path), max_model_len=128) as llm:
        own = llm.generate([prompt], params, use_tqdm=False)[0]
        assert own.prompt_token_ids == hf_tokenizer.encode(prompt)
        assert llm.get_tokenizer().decode(own.outputs[0].token_ids) == own.outputs[0].text
    with LLM(model=str(bare), tokenizer=str(folder), max_model_len=128) as llm:
        given = llm.generate([prompt], params, use_tqdm=False)[0]
    assert given.prompt_token_ids == own.prompt_token_ids and given.outputs[0].text == own.outputs[0].text
    with LLM(model=str(bare), max_model_len=128) as llm, pytest.raises(EngineError, match="tokenizer"):
        llm.generate([prompt], params, use_tqdm=False)


def test_unsupported_files_get_errors_naming_what(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "hf", "qwen3", tie_word_embeddings=True, **SHAPE)
    with pytest.raises(QuantizationError, match="type Q5_K is not supported"):
        convert_tensor("Q5_K", np.zeros((1, 176), np.uint8), (1, 256), "blk.0.attn_q.weight")
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LLM(model=str(not_gguf))
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'phi3' is not supported"):
        LLM(model=str(tmp_path / "phi.gguf"))
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    with pytest.raises(QuantizationError, match="GGUF file"):
        LLM(model=str(path), quantization="int8")


def test_q4_k_tensor_parallel_two_ranks_give_the_logits_of_one(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "hf", "qwen3", tie_word_embeddings=True, **SHAPE)
    path = write_gguf(folder, tmp_path / "m.gguf", "Q4_K", types=Q4_K_M)
    # timeout: on a loaded machine 120 s ran out
    check_two_ranks_match_one(path, tmp_path, PROMPTS, 6, timeout=300.0, atol=ATOL, rtol=RTOL)


def test_a_quantized_file_off_the_cpu_is_refused_before_loading(tmp_path):
    """The packed products are CPU kernels: on another device every linear would dequantize
    on the CPU and copy the float weight over, every step. An F16 file is plain floats."""
    folder = make_tiny_checkpoint(tmp_path / "hf", "qwen3", tie_word_embeddings=True, **SHAPE)
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    with pytest.raises(QuantizationError, match="Q8_0 tensors, which run on CPU only yet.*'cuda'"):
        load_model(path, device="cuda")
