"""The output thread's text layer: token ids -> streamed text, cut at stop strings.

- :mod:`~pyengine.text.decode_table` — :class:`DecodeTable`, built once per tokenizer:
  every token id's bytes, so that decoding a step is a table lookup.
- :mod:`~pyengine.text.detokenizer` — :class:`IncrementalDetokenizer`, one per output
  sequence: token ids in, text deltas out, never a split character as U+FFFD.
- :mod:`~pyengine.text.stop_strings` — :class:`StopStringMatcher`: finds stop strings
  across deltas and holds back text that a later match could still cut.
- :mod:`~pyengine.text.text_stream` — :class:`TextStream`, the two chained; what the
  output thread calls once per sequence per step.
- :mod:`~pyengine.text.token_pieces` — :class:`TokenPieces`: one token's text on its own
  (``Logprob.decoded_token``).
"""

from pyengine.text.decode_table import DecodeTable
from pyengine.text.detokenizer import IncrementalDetokenizer
from pyengine.text.stop_strings import StopStringMatcher
from pyengine.text.text_delta import TextDelta
from pyengine.text.text_stream import TextStream
from pyengine.text.token_pieces import TokenPieces

__all__ = ["DecodeTable", "IncrementalDetokenizer", "StopStringMatcher", "TextDelta", "TextStream", "TokenPieces"]
