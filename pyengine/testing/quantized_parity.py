"""The checks a quantized model passes against Hugging Face transformers running the float
weights its values stand for: prefill logits within float32 rounding, and greedy tokens
equal. Models quantized at load (``quantization="int8"`` / ``"int4"``, dense and
mixture-of-experts) and quantized checkpoints (GPTQ, AWQ, compressed-tensors) are held
to the same definition of "matches" through these functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pyengine.entrypoints.llm import LLM
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.dequantized import write_dequantized_checkpoint
from pyengine.testing.hand_plan import prefill_alone
from pyengine.testing.transformers_reference import reference_greedy_tokens, reference_logits


def quantized_runner(path: Path, method: str) -> ModelRunner:
    """A model runner over ``path`` quantized at load with ``method`` (room for 8 rows of 256 tokens)."""
    return ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64,
                                                            quantization=method))


def greedy_tokens(model: Path, prompts: list[list[int]], max_tokens: int, *, max_model_len: int = 256,
                  **llm_options: Any) -> list[list[int]]:
    """``LLM(model, max_model_len=..., **llm_options)``'s greedy tokens (EOS ignored) for each prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(model), max_model_len=max_model_len, **llm_options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_prefill_matches_dequantized(runner: ModelRunner, checkpoint: Path, workdir: Path, *,
                                       atol: float, rtol: float) -> None:
    """The ``runner`` quantized at load gives, on a 70-token prefill, transformers' logits on
    its dequantized weights (within ``atol`` / ``rtol``), and differs from the float
    checkpoint's by more than ten times ``atol`` (the quantized model is a different model,
    so the check can fail)."""
    reference_path = write_dequantized_checkpoint(runner.model, checkpoint, workdir / "dequantized")
    prompt = list(range(3, 73))
    _, ours = prefill_alone(runner, prompt)
    torch.testing.assert_close(ours, reference_logits(reference_path, prompt), atol=atol, rtol=rtol)
    assert float((ours - reference_logits(checkpoint, prompt)).abs().max()) > 10 * atol


def assert_greedy_matches_dequantized(checkpoint: Path, method: str, workdir: Path,
                                      prompts: list[list[int]], max_tokens: int = 12) -> None:
    """``LLM`` quantized at load with ``method`` generates, greedily, the tokens transformers
    gives on the dequantized weights."""
    runner = quantized_runner(checkpoint, method)
    reference_path = write_dequantized_checkpoint(runner.model, checkpoint, workdir / "dequantized")
    del runner
    theirs = reference_greedy_tokens(reference_path, prompts, max_tokens)
    assert greedy_tokens(checkpoint, prompts, max_tokens, quantization=method) == theirs
