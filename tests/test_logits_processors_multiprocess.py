"""Custom logits processors and the processor fields with an engine core in another
process: the class crosses as its qualified name and is imported in the core; one that
cannot be imported there is a clear error."""

from __future__ import annotations

import asyncio
import importlib
import re
from pathlib import Path

import pytest

from pyengine import (
    EngineConfig,
    EngineError,
    InvalidConfigError,
    LinkOptions,
    LogitsProcessor,
    SamplingParams,
    make_engine_client,
)
from pyengine.testing.checkpoints import make_tiny_checkpoint

DOC = Path(__file__).resolve().parents[1] / "docs" / "logits_processors.md"
MODULE = "pyengine_test_target_processor"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mp-procs") / "qwen3", "qwen3", seed=5)


@pytest.fixture
def processor_module(tmp_path, monkeypatch):
    """The docs' example written as a module on the path of this process and of the core
    processes it starts (PYTHONPATH)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (tmp_path / f"{MODULE}.py").write_text(next(b for b in blocks if "class TargetTokenLogitsProcessor" in b))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return importlib.import_module(MODULE)


async def _tokens(engine, prompt, params):
    outs = [o async for o in engine.generate(prompt, params, None, output_kind="final")]
    return outs[-1].outputs[0].token_ids


def test_a_custom_processor_and_the_fields_cross_to_the_core(checkpoint, processor_module):
    eng = make_engine_client(EngineConfig.from_kwargs(
        str(checkpoint), max_num_seqs=8, num_kv_blocks=64,
        logits_processors=[processor_module.TargetTokenLogitsProcessor]), multiprocess=True,
        link=LinkOptions(start_timeout=120))
    try:
        async def run():
            forced = await _tokens(eng, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                                  extra_args={"target_token": 42}))
            biased = await _tokens(eng, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                                  logit_bias={99: 100.0}))
            allowed = await _tokens(eng, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                                   allowed_token_ids=[7, 8]))
            with pytest.raises(EngineError, match="target_token must be a token id"):
                await _tokens(eng, [5], SamplingParams(max_tokens=2, extra_args={"target_token": -3}))
            return forced, biased, allowed

        forced, biased, allowed = asyncio.run(asyncio.wait_for(run(), 120))
        assert forced == [42] * 4 and biased == [99] * 4 and set(allowed) <= {7, 8}
    finally:
        eng.shutdown()


def test_a_class_the_core_cannot_import_is_refused_at_once(checkpoint):
    class Local(LogitsProcessor):  # defined in a function: no name imports it
        pass

    with pytest.raises(InvalidConfigError, match="logits_processors: .*Local cannot be imported by name"):
        make_engine_client(EngineConfig.from_kwargs(str(checkpoint), logits_processors=[Local]), multiprocess=True)


def test_a_name_the_core_cannot_import_fails_the_start_naming_it(checkpoint):
    with pytest.raises(EngineError, match="cannot import 'no_such_module.Processor'"):
        make_engine_client(EngineConfig.from_kwargs(str(checkpoint), logits_processors=["no_such_module.Processor"]),
                           multiprocess=True, link=LinkOptions(start_timeout=120))
