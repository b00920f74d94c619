"""The text of a request whose engine core sends token ids only, made in the front end.

Detokenizing every streamed token costs the engine core's output thread about a third of
its per-token work, on the CPU the forward passes run on. A core needs the text itself only
to find stop strings; for every other streamed request the front end (another process, on
other CPUs) makes the text from the ids the core sends anyway, with the same
:class:`~pyengine.text.text_stream.TextStream` the core would have used, so the text is the
same to the byte: the prompt as decoding context, ``skip_special_tokens``, and the core's
rule that the token ending a sample (EOS or a stop token id) adds no text unless
``include_stop_str_in_output``. A sample can also end with "stop" on another token (a
grammar that is complete): its last token keeps its text then.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pyengine.sampling_params import SamplingParams
from pyengine.text.decode_table import DecodeTable
from pyengine.text.text_stream import TextStream


def makes_text_in_front_end(params: SamplingParams, table: Optional[DecodeTable], wire_kind: str) -> bool:
    """Whether the front end makes this request's text: a streamed (delta) request that
    wants text, has no stop strings (the core must see text to stop at one) and no
    ``best_of`` (its final output renumbers the candidates), with a tokenizer here."""
    return (table is not None and wire_kind == "delta" and params.detokenize and not params.stop_strings
            and params.num_candidates == params.n)


class FrontEndText:
    """Each sample's text stream of one request; driven by one thread (the link's receiver)."""

    __slots__ = ("_table", "_prompt_token_ids", "_params", "_stop_ids", "_streams")

    def __init__(self, table: DecodeTable, prompt_token_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Sequence[int]) -> None:
        self._table = table
        self._prompt_token_ids = prompt_token_ids
        self._params = params
        # The ids that end a sample in the core's scheduler: its stop token ids, and the
        # model's EOS ids unless ignore_eos.
        self._stop_ids = frozenset(params.stop_token_ids or ()) | frozenset(() if params.ignore_eos else eos_token_ids)
        self._streams: dict[int, TextStream] = {}

    def delta(self, index: int, token_ids: Sequence[int], finish_reason: Optional[str]) -> str:
        """The text that sample ``index``'s new ``token_ids`` add; at its end (a finish
        reason) also what the detokenizer held back."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = TextStream.from_sampling_params(self._table, self._prompt_token_ids,
                                                                            self._params)
        if (finish_reason == "stop" and token_ids and token_ids[-1] in self._stop_ids
                and not self._params.include_stop_str_in_output):
            token_ids = token_ids[:-1]  # the EOS / stop token that ended the sample: no text
        text = stream.add(token_ids).text if token_ids else ""
        if finish_reason is not None:
            text += stream.finish()
            del self._streams[index]
        return text
