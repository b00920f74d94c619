"""Engine arguments users pass as they would to vLLM: dtype aliases, the accepted no-op
arguments, hub revision / download folder, task / runner, generation_config."""

from __future__ import annotations

import pytest
import torch

from pyengine import EngineConfig, InvalidConfigError
from pyengine.executor.config import ExecutorConfig
from pyengine.models.loader import resolve_dtype


def test_an_unknown_argument_is_still_an_error_naming_it():
    with pytest.raises(InvalidConfigError, match="no_such_argument"):
        EngineConfig.from_kwargs(None, no_such_argument=1)


@pytest.mark.parametrize("given, canonical", [
    ("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("float32", "float32"), ("auto", "auto"), ("HALF", "float16"),
    (torch.float16, "float16"), (torch.bfloat16, "bfloat16"), (torch.float32, "float32"),
])
def test_dtype_aliases_are_stored_as_the_canonical_name(given, canonical):
    assert EngineConfig.from_kwargs(None, dtype=given).dtype == canonical
    assert EngineConfig(dtype=given).executor_config().dtype == canonical
    assert ExecutorConfig(dtype=given).dtype == canonical
    if canonical != "auto":
        assert resolve_dtype(given, torch.device("cpu")) == getattr(torch, canonical)


@pytest.mark.parametrize("bad", ["int8", torch.int8, 16])
def test_a_dtype_that_is_no_alias_is_an_error_naming_dtype(bad):
    with pytest.raises(InvalidConfigError, match="dtype"):
        EngineConfig.from_kwargs(None, dtype=bad)
