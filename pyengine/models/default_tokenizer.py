"""The built-in default model's tokenizer: a small byte-level BPE trained on the spot.

Training takes well under a second and needs only the ``tokenizers`` package, so the
default model ships no vocabulary file. The text includes CJK and emoji, so streaming
detokenization meets multi-byte characters split across tokens. Tests and benchmarks
use it too (``pyengine.testing.checkpoints``).
"""

from __future__ import annotations

import json
from pathlib import Path

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler plans the next step while the executor runs this one.",
    "Hello, world! Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "def generate(prompt, max_tokens=16):\n    return model(prompt)\n",
    "你好，世界！今天天气很好。我们正在测试分词器。",
    "日本語のテキストも少し入れます。こんにちは。",
    "한국어 문장도 있습니다. 안녕하세요.",
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 and mixed text 数字 123.",
    "Ünïcödé àccents, ß, ø, and Ελληνικά γράμματα.",
]


def train_tokenizer(vocab_size: int):
    """A ``tokenizers.Tokenizer`` with at most ``vocab_size`` entries, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT * 4, trainer=trainer)
    return tokenizer


def save_tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json; return the special tokens' ids."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(folder / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[token]): {
                "content": token,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for token in SPECIAL_TOKENS
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    return ids
