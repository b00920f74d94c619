"""IncrementalDetokenizer against the tokenizer's own full decode, on tokenizers trained here.

Byte-level BPE (the test factory's) must match ``tokenizer.decode(output_ids)`` exactly for
any token sequence, and never put U+FFFD in a delta for valid text; the SentencePiece
byte-fallback and generic (window) paths are checked on valid text in their prompt context.
"""

from __future__ import annotations

import json
import random
from typing import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pyengine.models.default_tokenizer import EOS_TOKEN, IM_START_TOKEN, train_tokenizer
from pyengine.text import DecodeTable, IncrementalDetokenizer

REPLACEMENT = "\ufffd"
MULTILINGUAL = [
    "你好，世界！今天天气很好。",
    "日本語のテキスト、こんにちは。",
    "한국어 문장도 있습니다. 안녕하세요.",
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 and mixed text 数字 123.",
    "Ünïcödé àccents, ß, ø, and Ελληνικά γράμματα.",
    "The quick brown fox 🦊 jumps over the lazy dog 🐶 寿司 🍣.",
    "Rare characters the tokenizer never saw: 鬱 𠀋 🧬 🫠 ꙮ.",
]


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return train_tokenizer(512)


@pytest.fixture(scope="module")
def byte_level_table(byte_level: Tokenizer) -> DecodeTable:
    return DecodeTable.from_tokenizer(byte_level)


def stream(detokenizer: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]) -> list[str]:
    """All deltas for ``chunks`` (one add per chunk), the flush last."""
    return [detokenizer.add(chunk) for chunk in chunks] + [detokenizer.flush()]


def one_by_one(ids: Sequence[int]) -> list[list[int]]:
    return [[token_id] for token_id in ids]


def random_chunks(rng: random.Random, ids: Sequence[int]) -> list[list[int]]:
    """``ids`` split into runs of 0..3 ids (a step may carry none, or several)."""
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(0, 3)
        chunks.append(list(ids[i : i + size]))
        i += size
    return chunks


# --- byte-level BPE: exact ---


def test_the_factory_tokenizer_gets_a_byte_table(byte_level_table: DecodeTable) -> None:
    assert byte_level_table.is_byte_mapped
    assert not byte_level_table.strips_leading_space


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_multilingual_text_streams_without_replacement_chars(
    byte_level: Tokenizer, byte_level_table: DecodeTable, skip_special_tokens: bool
) -> None:
    for text in MULTILINGUAL:
        ids = byte_level.encode(text).ids
        # The rare characters really are split across byte tokens.
        assert any(REPLACEMENT in byte_level.decode([token_id]) for token_id in ids)
        deltas = stream(
            IncrementalDetokenizer(byte_level_table, [], skip_special_tokens=skip_special_tokens),
            one_by_one(ids),
        )
        assert all(REPLACEMENT not in delta for delta in deltas), deltas
        assert "".join(deltas) == text == byte_level.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_character_comes_out_whole_on_its_last_byte(
    byte_level: Tokenizer, byte_level_table: DecodeTable
) -> None:
    ids = byte_level.encode("🧬").ids  # four bytes, unseen in training: several tokens
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(byte_level_table, [])
    assert [detokenizer.add([token_id]) for token_id in ids] == [""] * (len(ids) - 1) + ["🧬"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_the_full_decode(
    byte_level: Tokenizer, byte_level_table: DecodeTable, skip_special_tokens: bool
) -> None:
    """Any ids, specials and invalid UTF-8 included, in any step sizes: deltas join to decode()."""
    rng = random.Random(1234)
    vocab_size = byte_level.get_vocab_size()
    for _ in range(400):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 6))]
        detokenizer = IncrementalDetokenizer(
            byte_level_table, prompt, skip_special_tokens=skip_special_tokens
        )
        deltas = stream(detokenizer, random_chunks(rng, ids))
        assert "".join(deltas) == byte_level.decode(ids, skip_special_tokens=skip_special_tokens)


def test_random_byte_tokens_hold_back_only_unfinished_characters(
    byte_level: Tokenizer, byte_level_table: DecodeTable
) -> None:
    """Random *valid* UTF-8 spelled with single-byte tokens: no delta ever has U+FFFD."""
    rng = random.Random(7)
    byte_ids = [byte_level.token_to_id(piece) for piece in _byte_level_pieces_by_byte()]
    for _ in range(200):
        text = "".join(
            chr(
                rng.choice(
                    [
                        rng.randrange(0x20, 0x7F),
                        rng.randrange(0x4E00, 0x9FFF),
                        rng.randrange(0x1F300, 0x1FAFF),
                        rng.randrange(0x80, 0x800),
                    ]
                )
            )
            for _ in range(rng.randint(1, 12))
        )
        ids = [byte_ids[byte] for byte in text.encode("utf-8")]
        deltas = stream(IncrementalDetokenizer(byte_level_table, []), random_chunks(rng, ids))
        assert all(REPLACEMENT not in delta for delta in deltas)
        assert "".join(deltas) == text


def test_special_tokens_are_skipped_or_kept(byte_level: Tokenizer, byte_level_table: DecodeTable) -> None:
    ids = [
        byte_level.token_to_id(IM_START_TOKEN),
        *byte_level.encode("你好").ids,
        byte_level.token_to_id(EOS_TOKEN),
    ]
    skipped = stream(IncrementalDetokenizer(byte_level_table, [], skip_special_tokens=True), one_by_one(ids))
    kept = stream(IncrementalDetokenizer(byte_level_table, [], skip_special_tokens=False), one_by_one(ids))
    assert "".join(skipped) == "你好"
    assert "".join(kept) == f"{IM_START_TOKEN}你好{EOS_TOKEN}"
    assert kept[0] == IM_START_TOKEN and kept[-2] == EOS_TOKEN


def test_added_tokens_decode_as_the_tokenizer_does() -> None:
    """Added tokens go through the ByteLevel decoder too: mapped when they can be, raw otherwise."""
    from tokenizers import AddedToken

    tokenizer = train_tokenizer(512)
    tokenizer.add_tokens(
        [
            AddedToken("é foo", special=False),
            AddedToken("Ġbar", special=False),
            AddedToken("é", special=False),
        ]
    )
    tokenizer.add_special_tokens(
        [AddedToken("<end of turn>", special=True), AddedToken("<ĠX>", special=True)]
    )
    table = DecodeTable.from_tokenizer(tokenizer)
    ids = [tokenizer.token_to_id(piece) for piece in ["é foo", "Ġbar", "<end of turn>", "<ĠX>", "é"]]
    for skip in (True, False):
        deltas = stream(IncrementalDetokenizer(table, [], skip_special_tokens=skip), one_by_one(ids))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_ids_beyond_the_vocabulary_add_no_text(byte_level: Tokenizer, byte_level_table: DecodeTable) -> None:
    """LM heads are often padded past the tokenizer's vocabulary; decode() ignores those ids."""
    ids = [*byte_level.encode("hi").ids, 100_000, *byte_level.encode(" 你").ids]
    deltas = stream(IncrementalDetokenizer(byte_level_table, []), [ids[:2], ids[2:]])
    assert "".join(deltas) == byte_level.decode(ids) == "hi 你"


def test_an_unfinished_character_is_flushed_as_the_full_decode_writes_it(
    byte_level: Tokenizer, byte_level_table: DecodeTable
) -> None:
    ids = byte_level.encode("ok 🧬").ids[:-1]  # the emoji's last byte never comes
    detokenizer = IncrementalDetokenizer(byte_level_table, [])
    streamed = "".join(detokenizer.add([token_id]) for token_id in ids)
    assert REPLACEMENT not in streamed
    tail = detokenizer.flush()
    assert streamed + tail == byte_level.decode(ids) and tail.endswith(REPLACEMENT)
    assert detokenizer.flush() == ""


def test_numpy_ids_are_accepted(byte_level: Tokenizer, byte_level_table: DecodeTable) -> None:
    np = pytest.importorskip("numpy")
    ids = np.asarray(byte_level.encode("寿司 🍣").ids, dtype=np.int64)
    deltas = stream(
        IncrementalDetokenizer(byte_level_table, np.asarray([1, 2])), [ids[:1], ids[1:3], ids[3:]]
    )
    assert "".join(deltas) == "寿司 🍣"


# --- SentencePiece-style byte fallback ("<0xE4>" tokens, "▁" spaces, leading-space strip) ---


def sentencepiece_byte_fallback(*, strip: bool) -> Tokenizer:
    """A Llama-2-style tokenizer: BPE over "▁"-joined text, an alphabet too small for CJK and
    emoji (so they fall back to "<0xE4>" tokens), decoder Replace/ByteFallback/Fuse[/Strip]."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40, show_progress=False
    )
    tokenizer.train_from_iterator(MULTILINGUAL * 4, trainer=trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip:
        steps.append(decoders.Strip(" ", 1, 0))
    spec["decoder"] = json.loads(decoders.Sequence(steps).__getstate__())
    return Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize("strip", [True, False])
def test_sentencepiece_byte_fallback_streams_whole_characters(strip: bool) -> None:
    tokenizer = sentencepiece_byte_fallback(strip=strip)
    table = DecodeTable.from_tokenizer(tokenizer)
    assert table.is_byte_mapped and table.strips_leading_space == strip
    bos = tokenizer.token_to_id("<s>")
    rng = random.Random(3)
    for text in MULTILINGUAL:
        ids = tokenizer.encode(text).ids
        assert any(tokenizer.id_to_token(token_id).startswith("<0x") for token_id in ids)
        # No context (or only a skipped BOS): the text is the output's own decode.
        for prompt in ([], [bos]):
            deltas = stream(IncrementalDetokenizer(table, prompt), random_chunks(rng, ids))
            assert all(REPLACEMENT not in delta for delta in deltas)
            assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        # With a prompt, the output keeps the leading space it has in the whole text.
        prompt = tokenizer.encode("Hello").ids
        deltas = stream(IncrementalDetokenizer(table, [bos, *prompt]), one_by_one(ids))
        whole, context = tokenizer.decode([bos, *prompt, *ids]), tokenizer.decode([bos, *prompt])
        assert "".join(deltas) == whole[len(context) :] and whole.startswith(context)
        assert deltas[0].startswith(" ")
        # A kept BOS is text too: the space after it survives, as in decode(..., False).
        kept = stream(IncrementalDetokenizer(table, [bos], skip_special_tokens=False), one_by_one(ids))
        assert "<s>" + "".join(kept) == tokenizer.decode([bos, *ids], skip_special_tokens=False)


# --- other decoders: the window fallback ---


def wordpiece() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[SEP]"], show_progress=False
    )
    tokenizer.train_from_iterator(MULTILINGUAL * 4, trainer=trainer)
    return tokenizer


def test_other_decoders_use_the_window_and_keep_context() -> None:
    tokenizer = wordpiece()
    table = DecodeTable.from_tokenizer(tokenizer)
    assert not table.is_byte_mapped
    sep = tokenizer.token_to_id("[SEP]")
    for text in ["the quick brown fox jumps over the lazy dog", "hello world 数字 123 mixed text"]:
        prompt, ids = tokenizer.encode("mixed text").ids, [*tokenizer.encode(text).ids, sep]
        for skip in (True, False):
            deltas = stream(IncrementalDetokenizer(table, prompt, skip_special_tokens=skip), one_by_one(ids))
            whole = tokenizer.decode([*prompt, *ids], skip_special_tokens=skip)
            context = tokenizer.decode(prompt, skip_special_tokens=skip)
            assert whole.startswith(context) and "".join(deltas) == whole[len(context) :]


def test_the_window_stays_bounded_when_ids_add_no_text() -> None:
    tokenizer = wordpiece()
    table = DecodeTable.from_tokenizer(tokenizer)
    sep = tokenizer.token_to_id("[SEP]")
    detok = IncrementalDetokenizer(table, tokenizer.encode("mixed text").ids, skip_special_tokens=True)
    ids = [*[sep] * 500, *tokenizer.encode("hello world").ids]
    deltas = stream(detok, one_by_one(ids))
    assert len(detok._strategy._ids) < 32, "skipped ids must not pile up in the window"
    assert "".join(deltas) == tokenizer.decode([*tokenizer.encode("mixed text").ids, *ids])[len("mixed text"):]


def test_the_window_fallback_holds_split_characters_too(byte_level: Tokenizer) -> None:
    table = DecodeTable.window_only(byte_level)  # force the fallback on byte-level BPE
    rng = random.Random(5)
    for text in MULTILINGUAL:
        ids = byte_level.encode(text).ids
        deltas = stream(
            IncrementalDetokenizer(table, byte_level.encode("prompt: ").ids), random_chunks(rng, ids)
        )
        assert all(REPLACEMENT not in delta for delta in deltas)
        assert "".join(deltas) == text


def _byte_level_pieces_by_byte() -> list[str]:
    """GPT-2's byte -> character table (each byte's single-byte token in a byte-level vocab)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    pieces = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(b for b in range(256) if b not in pieces):
        pieces[byte] = chr(256 + offset)
    assert set(pieces.values()) == set(alphabet)
    return [pieces[byte] for byte in range(256)]
