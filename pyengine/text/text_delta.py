"""The text one step adds to a sequence, and whether a stop string ended it."""

from __future__ import annotations

from typing import NamedTuple, Optional


class TextDelta(NamedTuple):
    """New text to stream for one sequence, and the stop string that ended it (if any).

    ``stopped`` is the stop string that matched, set by the call that found it and by every
    later call (which add no text); ``None`` while the sequence runs on. A named tuple:
    immutable and cheap to build, since the output thread makes one per sequence per step.
    """

    text: str
    stopped: Optional[str] = None
