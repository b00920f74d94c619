"""One output sequence's text: detokenizer, then stop strings. The output thread's per-step call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

from pyengine.text.decode_table import DecodeTable
from pyengine.text.detokenizer import IncrementalDetokenizer
from pyengine.text.stop_strings import StopStringMatcher
from pyengine.text.text_delta import TextDelta

if TYPE_CHECKING:
    from pyengine.sampling_params import SamplingParams

__all__ = ["TextStream"]


class TextStream:
    """The text of one output sequence, grown a step at a time.

    Each :meth:`add` detokenizes the step's new token ids, runs the text through the stop
    strings, and returns what may be streamed now. Once a stop string matched (or
    :meth:`finish` was called) further ids are ignored: with a pipelined scheduler a
    finished sequence may still receive one more token, which must not reach the text.

    One thread (the output thread) drives a stream; only the :class:`DecodeTable` is shared.

    Args:
        table: the tokenizer's :class:`DecodeTable`, shared by all sequences.
        prompt_token_ids: the prompt, the context for decoding the first output tokens.
        skip_special_tokens: leave special tokens out of the text.
        stop: stop strings; the text ends where the first one completes.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    __slots__ = ("_detokenizer", "_matcher", "_parts", "_done")

    def __init__(
        self,
        table: DecodeTable,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Union[str, Sequence[str]] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            table, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._matcher = StopStringMatcher(stop, include_stop_str_in_output)
        self._parts: list[str] = []  # streamed deltas; `text` joins them (and keeps the join)
        self._done = False  # a stop string matched, or finish() was called

    @classmethod
    def from_sampling_params(
        cls, table: DecodeTable, prompt_token_ids: Sequence[int], params: "SamplingParams"
    ) -> "TextStream":
        """A stream configured by a request's ``skip_special_tokens``, ``stop`` and
        ``include_stop_str_in_output``."""
        return cls(
            table,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    @property
    def text(self) -> str:
        """Everything streamed so far (joined on demand: O(length), so stream the deltas)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def stopped(self) -> Optional[str]:
        """The stop string that ended the text, or ``None``."""
        return self._matcher.stopped

    @property
    def finished(self) -> bool:
        """True once a stop string matched or :meth:`finish` was called."""
        return self._done

    def add(self, token_ids: Sequence[int]) -> TextDelta:
        """Append one step's new token ids; return the text to stream and any stop string matched."""
        if self._done:
            return TextDelta("", self._matcher.stopped)
        delta = self._matcher.feed(self._detokenizer.add(token_ids))
        if delta.text:
            self._parts.append(delta.text)
        if delta.stopped is not None:
            self._done = True
        return delta

    def finish(self) -> str:
        """End of sequence (EOS, length, abort): return the last text held back, if any.

        The detokenizer releases an unfinished character (as U+FFFD), which may still
        complete a stop string; then the stop matcher releases its held-back tail.
        """
        if self._done:
            return ""
        self._done = True
        tail = self._matcher.feed(self._detokenizer.flush()).text + self._matcher.flush()
        if tail:
            self._parts.append(tail)
        return tail
