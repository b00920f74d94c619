"""The engine's ``dead_end`` finish reason is not OpenAI's: through the server (spoken with
the official openai client), whole and streamed, chat and completions, a dead-ended choice
says ``finish_reason="stop"`` with ``stop_reason="dead_end"``. A dead end is provoked the
way the engine documents it: an executor that does not apply the mask samples a token the
grammar refuses."""

from __future__ import annotations

import openai
import pytest

from pyengine import AsyncEngine
from pyengine.executor.grammar_mask import GrammarMaskApplier
from pyengine.server import ServerArgs
from pyengine.server.choices import openai_finish
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer

#: No random-weight model's first unmasked token spells a prefix of this.
REGEX = {"structured_outputs": {"regex": "qqqqqqqqqqqqqqqqqqqq"}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = AsyncEngine(make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt")), max_num_seqs=8, max_model_len=256)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with LiveServer(engine, ServerArgs(model_name="m", stats_interval=0, log_requests=False)) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0) as c:
            yield c


@pytest.fixture
def masks_not_applied(monkeypatch):
    monkeypatch.setattr(GrammarMaskApplier, "apply", lambda self, plan, logits: logits)


def dead_ended(choice) -> bool:
    return choice.finish_reason == "stop" and choice.model_extra.get("stop_reason") == "dead_end"


def test_the_mapping():
    assert openai_finish("dead_end", None) == ("stop", "dead_end")
    assert openai_finish("stop", "</s>") == ("stop", "</s>")
    assert openai_finish("length", None) == ("length", None)


def test_a_dead_end_is_a_stop_with_its_reason_whole(client, masks_not_applied):
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="m", messages=messages, n=3, max_tokens=8, extra_body=REGEX)
    assert all(dead_ended(c) for c in chat.choices), [(c.finish_reason, c.model_extra) for c in chat.choices]
    assert all(c.message.content == "" or c.message.content is None for c in chat.choices)
    done = client.completions.create(model="m", prompt="Hi", n=2, max_tokens=8, extra_body=REGEX)
    assert all(dead_ended(c) for c in done.choices), [(c.finish_reason, c.model_extra) for c in done.choices]


def test_a_dead_end_is_a_stop_with_its_reason_streamed(client, masks_not_applied):
    messages = [{"role": "user", "content": "Hi"}]
    chunks = list(client.chat.completions.create(
        model="m", messages=messages, max_tokens=8, stream=True, extra_body=REGEX))
    ends = [c for chunk in chunks for c in chunk.choices if c.finish_reason is not None]
    assert len(ends) == 1 and dead_ended(ends[0]), ends
    chunks = list(client.completions.create(model="m", prompt="Hi", max_tokens=8, stream=True, extra_body=REGEX))
    ends = [c for chunk in chunks for c in chunk.choices if c.finish_reason is not None]
    assert len(ends) == 1 and dead_ended(ends[0]), ends


def test_a_constrained_output_that_completes_still_says_stop_alone(client):
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=30,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content in ("yes", "no")
    assert chat.choices[0].model_extra.get("stop_reason") != "dead_end"
