"""TextStream: real token ids through the detokenizer and the stop strings, as the output thread runs it."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from pyengine.models.default_tokenizer import EOS_TOKEN, train_tokenizer
from pyengine.sampling_params import SamplingParams
from pyengine.text import DecodeTable, TextDelta, TextStream


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(512)


@pytest.fixture(scope="module")
def table(tokenizer: Tokenizer) -> DecodeTable:
    return DecodeTable.from_tokenizer(tokenizer)


def feed_all(text_stream: TextStream, ids: list[int]) -> list[TextDelta]:
    return [text_stream.add([token_id]) for token_id in ids]


def test_a_stop_string_split_across_tokens_truncates_and_is_reported(
    tokenizer: Tokenizer, table: DecodeTable
) -> None:
    ids = tokenizer.encode("答案是：鬱金香。然后继续").ids
    stop = "鬱金"  # unseen characters: several byte tokens each
    stream = TextStream(table, [], stop=[stop])
    deltas = feed_all(stream, ids)
    stopped_at = next(i for i, delta in enumerate(deltas) if delta.stopped is not None)
    assert deltas[stopped_at].stopped == stop
    assert all(delta.stopped == stop and delta.text == "" for delta in deltas[stopped_at + 1 :])
    assert "".join(delta.text for delta in deltas) == stream.text == "答案是："
    assert stream.finished and stream.stopped == stop
    assert stream.finish() == ""


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer: Tokenizer, table: DecodeTable) -> None:
    ids = tokenizer.encode("Hello 🚀 world, more").ids
    stream = TextStream(table, [], stop=["🚀 wor"], include_stop_str_in_output=True)
    deltas = feed_all(stream, ids)
    assert stream.text == "".join(delta.text for delta in deltas) == "Hello 🚀 wor"
    assert stream.stopped == "🚀 wor"


def test_the_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer, table: DecodeTable) -> None:
    ids = tokenizer.encode("one two three four").ids
    stream = TextStream(table, [], stop=["four", "two", "thr"])
    feed_all(stream, ids)
    assert (stream.text, stream.stopped) == ("one ", "two")


def test_a_stop_string_in_the_prompt_is_not_matched(tokenizer: Tokenizer, table: DecodeTable) -> None:
    prompt = tokenizer.encode("Say STOP twice: STOP").ids
    stream = TextStream(table, prompt, stop=["STOP"])
    deltas = feed_all(stream, tokenizer.encode(" ok, done").ids)
    assert all(delta.stopped is None for delta in deltas)
    assert stream.finish() == "" and stream.text == " ok, done" and stream.stopped is None


def test_held_back_text_never_leaks_and_finish_releases_it(tokenizer: Tokenizer, table: DecodeTable) -> None:
    """Streamed text is always a prefix of the final text; finish() returns the tail held back."""
    rng = random.Random(2)
    words = ["你好", "世界", "😀", " ", "end", "en", "d!", "👍🏽", "STO", "P"]
    for _ in range(200):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        ids = tokenizer.encode(text).ids
        stops = rng.sample(["世界😀", "end!", "STOP", "👍🏽 ", "界"], k=rng.randint(1, 3))
        stream = TextStream(table, [], stop=stops)
        cut = min((text.find(s) for s in stops if s in text), default=len(text))
        streamed = ""
        for token_id in ids:
            streamed += stream.add([token_id]).text
            assert text[:cut].startswith(streamed)
        streamed += stream.finish()
        assert "\ufffd" not in streamed
        assert streamed == stream.text
        # These stops never overlap each other, so earliest start = earliest end.
        assert streamed == text[:cut]


def test_finish_releases_an_unfinished_character_and_the_held_tail(
    tokenizer: Tokenizer, table: DecodeTable
) -> None:
    ids = tokenizer.encode("abc <|").ids + tokenizer.encode("🧬").ids[:-1]
    stream = TextStream(table, [], stop=["<|x|>"])
    streamed = "".join(delta.text for delta in feed_all(stream, ids))
    assert streamed == "abc "
    assert stream.finish() == "<|\ufffd"
    assert stream.text == tokenizer.decode(ids)
    assert stream.finished and stream.add([ids[0]]) == TextDelta("")


def test_from_sampling_params(tokenizer: Tokenizer, table: DecodeTable) -> None:
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids = [*tokenizer.encode("keep going").ids, eos]
    params = SamplingParams(stop="going", include_stop_str_in_output=True, skip_special_tokens=False)
    stream = TextStream.from_sampling_params(table, [], params)
    feed_all(stream, ids)
    assert (stream.text, stream.stopped) == ("keep going", "going")

    kept = TextStream.from_sampling_params(table, [], SamplingParams(skip_special_tokens=False))
    feed_all(kept, ids)
    kept.finish()
    assert kept.text == f"keep going{EOS_TOKEN}"
