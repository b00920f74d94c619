"""The two checks every model quantized at load (``quantization="int8"`` / ``"int4"``)
passes against Hugging Face transformers running its dequantized weights: prefill logits
within float32 rounding, and greedy tokens equal. Dense and mixture-of-experts tests call
the same functions, so the two families are held to one definition of "matches"."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from pyengine.entrypoints.llm import LLM
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.dequantized import write_dequantized_checkpoint
from pyengine.testing.hand_plan import prefill_alone


def quantized_runner(path: Path, method: str) -> ModelRunner:
    """A model runner over ``path`` quantized at load with ``method`` (room for 8 rows of 256 tokens)."""
    return ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64,
                                                            quantization=method))


def assert_prefill_matches_dequantized(runner: ModelRunner, checkpoint: Path, workdir: Path, *,
                                       atol: float, rtol: float) -> None:
    """The quantized ``runner``'s prefill logits equal transformers' on the dequantized weights
    (within ``atol`` / ``rtol``), and differ from the float checkpoint's by more than ten
    times ``atol`` (the quantized model is a different model, so the check can fail)."""
    reference_path = write_dequantized_checkpoint(runner.model, checkpoint, workdir / "dequantized")
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32).eval()
    prompt = list(range(3, 73))
    _, ours = prefill_alone(runner, prompt)
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
        original = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)(
            torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol)
    assert float((ours - original).abs().max()) > 10 * atol


def assert_greedy_matches_dequantized(checkpoint: Path, method: str, workdir: Path,
                                      prompts: list[list[int]], max_tokens: int = 12) -> None:
    """``LLM`` quantized with ``method`` generates, greedily and ignoring EOS, the tokens that
    transformers' ``generate`` gives on the dequantized weights."""
    runner = quantized_runner(checkpoint, method)
    reference_path = write_dequantized_checkpoint(runner.model, checkpoint, workdir / "dequantized")
    del runner
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = [reference.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
                  for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(checkpoint), quantization=method, max_model_len=256) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == theirs
