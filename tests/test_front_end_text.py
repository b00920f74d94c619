"""Streamed text made in the front end from token ids (``front_text.py``) equals, delta by
delta, the text the engine core would have made: an engine core asked for no text
(``make_text=False``) sends ids only, and ``FrontEndText`` turns them into the same deltas,
on a script with multi-byte characters split across tokens, a sample ended by EOS or by a
stop token id (its text left out, or kept with ``include_stop_str_in_output``), one ended
by length, and ``skip_special_tokens`` either way."""

from __future__ import annotations

import threading

import pytest

from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.errors import InvalidRequestError
from pyengine.models.default_tokenizer import EOS_TOKEN, IM_END_TOKEN
from pyengine.multiprocess.front_text import FrontEndText, makes_text_in_front_end
from pyengine.sampling_params import SamplingParams
from pyengine.testing.synthetic_runner import ScriptedRunner

TEXT = "Grüße, naïve café — 東京 ✓ done"
PROMPT = [5, 6, 7]


class Collect:
    """A sink that keeps a request's delta outputs until its last one."""

    def __init__(self) -> None:
        self.outputs: list = []
        self.done = threading.Event()
        self.error = None

    def put(self, output) -> None:
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def fail(self, error) -> None:
        self.error = error
        self.done.set()


@pytest.fixture(scope="module")
def core():
    runner = ScriptedRunner([0], eos_token_ids=())
    tok = runner.loaded.tokenizer
    eos = tok.token_to_id(EOS_TOKEN)
    # Byte-level pieces of the accented and CJK characters land in separate tokens.
    runner.script = tok.encode(TEXT, add_special_tokens=False).ids + [tok.token_to_id(IM_END_TOKEN), eos]
    runner.loaded = type(runner.loaded)(tok, (eos,))
    engine = EngineCore(EngineConfig(max_num_seqs=4), runner=runner)
    yield engine, tok
    engine.shutdown()


def _run(engine, params, make_text, rid):
    sink = Collect()
    engine.add_request(rid, None, PROMPT, params, sink, kind="delta", make_text=make_text)
    assert sink.done.wait(30) and sink.error is None, sink.error
    return sink.outputs


CASES = {
    "eos": dict(),
    "eos kept, specials shown": dict(skip_special_tokens=False, include_stop_str_in_output=True),
    "eos, specials shown": dict(skip_special_tokens=False),
    "stop token id": dict(skip_special_tokens=False, stop_token_ids=["im_end"]),
    "stop token id kept": dict(skip_special_tokens=False, stop_token_ids=["im_end"], include_stop_str_in_output=True),
    "length": dict(max_tokens=9, ignore_eos=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_front_end_deltas_equal_the_cores(core, case):
    engine, tok = core
    fields = dict(CASES[case])
    fields["stop_token_ids"] = [tok.token_to_id(IM_END_TOKEN)] if fields.get("stop_token_ids") else None
    params = SamplingParams(**{"max_tokens": 60, **fields})
    made_in_core = _run(engine, params, True, f"core-{case}")
    ids_only = _run(engine, params, False, f"front-{case}")
    assert [o.outputs[0].token_ids for o in ids_only] == [o.outputs[0].token_ids for o in made_in_core]
    assert all(o.outputs[0].text == "" for o in ids_only)  # the core made no text
    text = FrontEndText(engine.decode_table, PROMPT, params, engine.eos_token_ids)
    deltas = [text.delta(0, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in ids_only]
    assert deltas == [o.outputs[0].text for o in made_in_core]
    assert len(deltas) > 5 and made_in_core[-1].outputs[0].finish_reason == ("length" if case == "length" else "stop")


def test_stop_strings_keep_the_text_in_the_core(core):
    engine, _ = core
    params = SamplingParams(max_tokens=20, stop=["café"])
    assert not makes_text_in_front_end(params, engine.decode_table, "delta")
    with pytest.raises(InvalidRequestError, match="stop strings"):
        engine.add_request("stops", None, PROMPT, params, Collect(), kind="delta", make_text=False)


def test_which_requests_get_their_text_in_the_front_end(core):
    engine, _ = core
    table = engine.decode_table
    assert makes_text_in_front_end(SamplingParams(), table, "delta")
    assert not makes_text_in_front_end(SamplingParams(), table, "final")  # decoded once, in the core
    assert not makes_text_in_front_end(SamplingParams(), None, "delta")  # no tokenizer here
    assert not makes_text_in_front_end(SamplingParams(detokenize=False), table, "delta")
    assert not makes_text_in_front_end(SamplingParams(n=1, best_of=2), table, "delta")
