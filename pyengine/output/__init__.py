"""The output thread's text layer: token ids -> streamed text, cut at stop strings.

- :mod:`~pyengine.output.decode_table` — :class:`DecodeTable`, built once per tokenizer:
  every token id's bytes, so that decoding a step is a table lookup.
- :mod:`~pyengine.output.detokenizer` — :class:`IncrementalDetokenizer`, one per output
  sequence: token ids in, text deltas out, never a split character as U+FFFD.
- :mod:`~pyengine.output.stop_strings` — :class:`StopStringMatcher`: finds stop strings
  across deltas and holds back text that a later match could still cut.
- :mod:`~pyengine.output.text_stream` — :class:`TextStream`, the two chained; what the
  output thread calls once per sequence per step.
"""

from pyengine.output.decode_table import DecodeTable
from pyengine.output.detokenizer import IncrementalDetokenizer
from pyengine.output.stop_strings import StopStringMatcher
from pyengine.output.text_delta import TextDelta
from pyengine.output.text_stream import TextStream

__all__ = ["DecodeTable", "IncrementalDetokenizer", "StopStringMatcher", "TextDelta", "TextStream"]
