"""Request preparation in the front end: a caller's prompt and parameters made into what is
sent to an engine core, checked before anything crosses the link.

The front end holds the model's tokenizer (sent by the core in its ``Ready``) and the
token table built from it once: it tokenizes, builds the request with ``build_request``
(``pyengine.inputs.request_checks``: checked against the model's limits, the prompt
truncated; the core queues it as built, without checking it again) and decides whether
it makes the streamed text itself (``front_text.py``). A constraint is compiled by the
core only, which needs it for its scheduler: a bad one comes back as that request's
error (the server waits for a constrained request's first output or error before it
answers, so it is still a 400).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Union

from pyengine.entrypoints.engine_client import normalize_off_loop
from pyengine.errors import InvalidRequestError
from pyengine.inputs.prompts import PromptType
from pyengine.inputs.request_checks import RequestLimits, build_request
from pyengine.logprob_arrays import Piece
from pyengine.multiprocess import wire
from pyengine.multiprocess.front_text import FrontEndText, makes_text_in_front_end
from pyengine.multiprocess.streams import wire_kind
from pyengine.outputs import OutputKind
from pyengine.sampling_params import PoolingParams, SamplingParams
from pyengine.text import DecodeTable, TokenPieces
from pyengine.text.encode import encode_ids


class PreparedRequest(NamedTuple):
    """A request built and ready to send: its prompt (text as given, ids truncated as the
    core will run them), its checked parameters, when the front end makes its text the
    text streams that do, and what makes ``Logprob.decoded_token`` here (None: the
    request does not detokenize)."""

    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: Union[SamplingParams, PoolingParams]
    text: Optional[FrontEndText]
    piece: Piece

    @property
    def pooling(self) -> bool:
        return isinstance(self.params, PoolingParams)


class RequestPreparer:
    """Built once the first core is ready (its ``CoreInfo`` has the tokenizer and limits)."""

    def __init__(self, info: wire.CoreInfo) -> None:
        self.info = info
        self.tokenizer = _tokenizer(info.tokenizer_json)
        # Built once (a pass over the vocabulary): streamed text is made here (front_text.py),
        # and the token table comes from it.
        self.decode_table = DecodeTable.from_tokenizer(self.tokenizer) if self.tokenizer is not None else None
        # Each token's text on its own, for the log-probability maps a caller reads.
        self.pieces = TokenPieces(self.tokenizer) if self.tokenizer is not None else None
        self.limits = RequestLimits(self.vocab_size, info.max_logprobs, info.max_model_len)

    @property
    def vocab_size(self) -> Optional[int]:
        if self.info.vocab_size:
            return self.info.vocab_size
        return self.tokenizer.get_vocab_size() if self.tokenizer is not None else None

    @property
    def token_bytes(self) -> Optional[Sequence[bytes]]:
        return self.decode_table.token_bytes if self.decode_table is not None else None

    async def prepare(self, prompt: PromptType, params: Union[SamplingParams, PoolingParams], kind: OutputKind,
                      tokenize: Optional[Callable[[str], list[int]]] = None) -> PreparedRequest:
        """Tokenizes (a long text off the loop; with ``tokenize``, the client's, when given)
        and builds the request (``build_request``); ``InvalidRequestError`` for a request
        the core would refuse."""
        text, ids = await normalize_off_loop(prompt, tokenize or self.tokenize)
        built = build_request(text, ids, params, self.limits)
        params, ids = built.params, built.prompt_token_ids  # the output's prompt_token_ids are these
        front_text, table, piece = None, self.decode_table, None
        if isinstance(params, SamplingParams):
            if table is not None and makes_text_in_front_end(params, table, wire_kind(kind)):
                front_text = FrontEndText(table, ids, params, self.info.eos_token_ids)
            piece = self.pieces if params.detokenize else None
        return PreparedRequest(text, ids, params, front_text, piece)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json: pass token ids instead of text")
        return encode_ids(self.tokenizer, text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _tokenizer(tokenizer_json: Optional[str]) -> Any:
    if tokenizer_json is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)
