"""Stop strings: find them in streamed text, also across deltas, and cut the text there."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from pyengine.errors import InvalidRequestError
from pyengine.text.text_delta import TextDelta

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Watches one sequence's text for stop strings and decides what may be streamed.

    Fed the detokenizer's deltas in order, it returns the part that is safe to stream:

    - When a stop string completes, the text is cut at its start (or kept through its end
      with ``include_stop_str_in_output``) and the match is reported; later text is dropped.
    - Otherwise the longest tail that could still grow into a stop string (at most
      ``len(longest stop) - 1`` characters) is held back, so a streamed delta never holds
      text that a later match would cut. With ``include_stop_str_in_output`` nothing needs
      holding back: a stop string is streamed whether or not it completes.

    When several stop strings occur, the one that completes first in the text wins (on a
    tie, the one that starts first). That is the match a character-by-character stream
    would find, so the result does not depend on how the text is split into deltas.

    Args:
        stop: the stop strings (non-empty; a single ``str`` is one stop string); an empty
            list matches nothing.
        include_stop_str_in_output: keep the matched stop string in the text.
    """

    __slots__ = (
        "_stops",
        "_prefix_heads",
        "_max_tail",
        "_include",
        "_tail",
        "_held",
        "_stopped",
    )

    def __init__(self, stop: Union[str, Sequence[str]], include_stop_str_in_output: bool = False) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {stops!r}")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        # (stop, its first character, its longest proper prefix's length) for the holdback scan.
        self._prefix_heads = tuple((s, s[0], len(s) - 1) for s in self._stops if len(s) > 1)
        self._max_tail = max((len(s) for s in self._stops), default=1) - 1
        self._include = include_stop_str_in_output
        self._tail = ""  # the last _max_tail characters seen (held back or streamed)
        self._held = 0  # how many characters at the end of _tail are not streamed yet
        self._stopped: Optional[str] = None

    @property
    def stopped(self) -> Optional[str]:
        """The stop string that ended the text, or ``None``."""
        return self._stopped

    def feed(self, text: str) -> TextDelta:
        """Take the next delta; return what to stream and the stop string if one completed.

        After a match every call returns empty text and the same stop string.
        """
        if self._stopped is not None:
            return TextDelta("", self._stopped)
        if not self._stops or not text:
            return TextDelta(text)
        window = self._tail + text  # no match lies wholly in _tail, so any match ends in text
        unstreamed_start = len(self._tail) - self._held
        match = self._first_match(window)
        if match is not None:
            stop, start = match
            self._stopped = stop
            self._tail, self._held = "", 0
            end = start + len(stop) if self._include else start
            return TextDelta(window[unstreamed_start:end], stop)
        held = 0 if self._include else self._holdback(window)
        self._tail = window[max(0, len(window) - self._max_tail) :] if self._max_tail else ""
        self._held = held
        return TextDelta(window[unstreamed_start : len(window) - held])

    def flush(self) -> str:
        """End of sequence: release the held-back text (it can no longer become a stop string)."""
        if self._held == 0:
            return ""
        released = self._tail[len(self._tail) - self._held :]
        self._held = 0
        return released

    def _first_match(self, window: str) -> Optional[tuple[str, int]]:
        """(stop string, start) of the match that ends first in ``window``, or ``None``."""
        best: Optional[tuple[str, int]] = None
        best_end = best_start = len(window) + 1
        for stop in self._stops:
            start = window.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if end < best_end or (end == best_end and start < best_start):
                best, best_end, best_start = (stop, start), end, start
        return best

    def _holdback(self, window: str) -> int:
        """Length of the longest tail of ``window`` that is a proper prefix of a stop string.

        A candidate tail starts with the stop string's first character, so str.find (in C)
        jumps between candidates; in most steps it finds none.
        """
        size = len(window)
        longest = 0
        for stop, first, longest_prefix in self._prefix_heads:
            start = window.find(first, size - longest_prefix if size > longest_prefix else 0)
            while start >= 0:
                if stop.startswith(window[start:]):  # the earliest candidate is the longest
                    if size - start > longest:
                        longest = size - start
                    break
                start = window.find(first, start + 1)
        return longest
