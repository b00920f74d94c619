"""Request preparation in the front end: a caller's prompt and parameters made into what is
sent to an engine core, checked before anything crosses the link.

The front end holds the model's tokenizer (sent by the core in its ``Ready``) and the
token table built from it once: it tokenizes, applies the request checks the core would
(``pyengine.inputs.request_checks``), compiles a constraint (so that a bad schema is
refused at once, as in-process, not one round trip later in the middle of a stream) and
decides whether it makes the streamed text itself (``front_text.py``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Union

from pyengine.engine.grammar import ConstraintCompiler
from pyengine.entrypoints.engine_client import normalize_off_loop
from pyengine.errors import InvalidRequestError
from pyengine.inputs.prompts import PromptType
from pyengine.inputs.request_checks import checked_params, truncated_prompt
from pyengine.multiprocess import wire
from pyengine.multiprocess.front_text import FrontEndText, makes_text_in_front_end
from pyengine.multiprocess.streams import wire_kind
from pyengine.outputs import OutputKind
from pyengine.sampling_params import PoolingParams, SamplingParams
from pyengine.text import DecodeTable
from pyengine.text.encode import encode_ids


class PreparedRequest(NamedTuple):
    """A request checked and ready to send: its prompt (text as given, ids truncated as
    the core will run them), its checked parameters and, when the front end makes its
    text, the text streams that do."""

    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: Union[SamplingParams, PoolingParams]
    text: Optional[FrontEndText]

    @property
    def pooling(self) -> bool:
        return isinstance(self.params, PoolingParams)


class RequestPreparer:
    """Built once the first core is ready (its ``CoreInfo`` has the tokenizer and limits)."""

    def __init__(self, info: wire.CoreInfo) -> None:
        self.info = info
        self.tokenizer = _tokenizer(info.tokenizer_json)
        # Built once (a pass over the vocabulary): streamed text is made here (front_text.py),
        # the token table and a constraint compiler come from it.
        self.decode_table = DecodeTable.from_tokenizer(self.tokenizer) if self.tokenizer is not None else None
        self._compiler: Optional[ConstraintCompiler] = None
        self._compiler_lock = threading.Lock()

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
        """Tokenizes (a long text off the loop; with ``tokenize``, the client's, when given),
        checks the parameters against the model's limits, truncates the prompt as asked,
        compiles a constraint; ``InvalidRequestError`` for a request the core would refuse."""
        text, ids = await normalize_off_loop(prompt, tokenize or self.tokenize)
        params = checked_params(params, ids, self.vocab_size, self.info.max_logprobs)
        ids = truncated_prompt(ids, params, self.info.max_model_len)  # the output's prompt_token_ids are these
        if isinstance(params, SamplingParams):
            await self.prepare_constraint(params)
        if not ids:
            raise InvalidRequestError("prompt is empty: at least one token is needed")
        front_text, table = None, self.decode_table
        if table is not None and isinstance(params, SamplingParams) and makes_text_in_front_end(
                params, table, wire_kind(kind)):
            front_text = FrontEndText(table, ids, params, self.info.eos_token_ids)
        return PreparedRequest(text, ids, params, front_text)

    async def prepare_constraint(self, sampling_params: SamplingParams) -> None:
        """Compiles the request's constraint here too (a worker thread, the GIL released;
        at once when cached), so that a bad schema or grammar is refused before anything is
        sent. The core compiles it again for its scheduler."""
        constraint = sampling_params.structured_outputs
        if constraint is None:
            return
        constraint.validate()
        compiler = self._compiler
        if compiler is not None and compiler.native is not None and compiler.is_cached(constraint):
            return
        await asyncio.to_thread(self._compile, constraint)

    def _compile(self, constraint: Any) -> None:
        """Compiles ``constraint`` as the core will (``InvalidRequestError`` when it is bad)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = ConstraintCompiler.for_engine(self.decode_table, list(self.info.eos_token_ids),
                                                               self.vocab_size)
        self._compiler.compile(constraint)

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
