"""Every core behind one front end serves the same model with the same limits: the front
end builds each request once (``build_request``) against the first core's limits, and a
core queues what it is sent without checking again. A core that differs (a ``pyengine
core`` started by hand with another ``--max-model-len`` or tokenizer) is refused when it
says it is ready, with the field named."""

from __future__ import annotations

import msgspec
import pytest

from pyengine.errors import EngineError
from pyengine.multiprocess import wire
from pyengine.multiprocess.cores import check_same_model


def _info(**changes) -> wire.CoreInfo:
    base = wire.CoreInfo(model_path="/m", max_model_len=2048, max_request_tokens=2048, vocab_size=1000,
                         max_logprobs=20, tokenizer_json='{"model": 1}', tokenizer_config={}, pid=1,
                         eos_token_ids=[2])
    return msgspec.structs.replace(base, **changes)


def test_cores_of_the_same_model_agree_whatever_their_pid_and_path():
    check_same_model(_info(), _info(pid=7, model_path="/elsewhere/m"), 1)


@pytest.mark.parametrize("changes, named", [
    (dict(max_model_len=4096), "max_model_len"),
    (dict(vocab_size=999), "vocab_size"),
    (dict(max_logprobs=5), "max_logprobs"),
    (dict(eos_token_ids=[3]), "eos_token_ids"),
    (dict(tokenizer_json='{"model": 2}'), "the tokenizer"),
])
def test_a_core_with_other_limits_is_refused_naming_the_field(changes, named):
    with pytest.raises(EngineError, match=f"engine core 1 differs from the first core in {named}"):
        check_same_model(_info(), _info(**changes), 1)
