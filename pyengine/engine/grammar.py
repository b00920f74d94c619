"""Compiling a request's ``StructuredOutputsParams`` into the grammar its samples follow.

The vocabulary (every token's bytes, the special tokens, the EOS ids) goes to Rust once,
when the engine starts, from the decode table the engine already builds. Compiling runs
in the thread that adds the request, with the GIL released, before the request is queued
(``AsyncEngine`` first compiles in a worker thread, off the event loop, and the add then
finds it in the cache); a bad schema, regex or grammar is an ``InvalidRequestError``
naming what is wrong. The same constraint compiled twice is compiled once (the cache is
in Rust). The scheduler thread never compiles: it only advances matchers and computes
masks.
"""

from __future__ import annotations

import logging
from typing import Optional

from pyengine._sched import CompiledConstraint, GrammarCompiler
from pyengine.errors import InvalidConfigError, InvalidRequestError
from pyengine.structured_outputs import StructuredOutputsParams
from pyengine.text import DecodeTable

logger = logging.getLogger(__name__)


class ConstraintCompiler:
    """Compiles constraints for one engine; ``unavailable`` says why it cannot (then every
    constrained request is refused with that reason, never generated unconstrained)."""

    def __init__(self, compiler: Optional[GrammarCompiler], unavailable: Optional[str] = None) -> None:
        self._compiler = compiler
        self.unavailable = unavailable

    @classmethod
    def for_engine(
        cls, decode_table: Optional[DecodeTable], eos_token_ids: list[int], vocab_size: Optional[int]
    ) -> ConstraintCompiler:
        if decode_table is None or decode_table.token_bytes is None:
            return cls(None, "structured_outputs cannot be enforced with this checkpoint: it needs a tokenizer "
                             "with a byte-level or byte-fallback decoder (token bytes)")
        if not eos_token_ids:
            return cls(None, "structured_outputs cannot be enforced with this checkpoint: it declares no "
                             "end-of-sequence token")
        with_special = decode_table.token_bytes
        without_special = decode_table.token_bytes_skipping_special or with_special
        special = [i for i, (a, b) in enumerate(zip(with_special, without_special)) if a and not b]
        size = max(vocab_size or 0, len(with_special))
        try:
            compiler = GrammarCompiler(list(with_special), special, list(eos_token_ids), size)
        except InvalidConfigError as error:
            # An engine that never sees a constraint must still start; constrained requests
            # are refused with the reason.
            logger.warning("structured outputs are unavailable for this model: %s", error)
            return cls(None, f"structured_outputs cannot be enforced with this checkpoint: its grammar "
                             f"vocabulary could not be built ({error})")
        return cls(compiler)

    @property
    def native(self) -> Optional[GrammarCompiler]:
        return self._compiler

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        """Whether ``compile(params)`` would be a cache hit (or cannot compile at all: then
        it fails at once); nothing is compiled."""
        if self._compiler is None:
            return True
        return self._compiler.is_cached(
            params.kind,
            params.spec_text(),
            disable_any_whitespace=params.disable_any_whitespace,
            disable_additional_properties=params.disable_additional_properties,
            whitespace_pattern=params.whitespace_pattern,
        )

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled constraint (cached); ``InvalidRequestError`` when it is invalid or
        this engine cannot enforce constraints."""
        if self._compiler is None:
            raise InvalidRequestError(self.unavailable or "structured outputs are unavailable")
        params.validate()
        kind = params.kind
        try:
            return self._compiler.compile(
                kind,
                params.spec_text(),
                disable_any_whitespace=params.disable_any_whitespace,
                disable_additional_properties=params.disable_additional_properties,
                whitespace_pattern=params.whitespace_pattern,
            )
        except InvalidRequestError as error:
            # Named by the field, as every structured_outputs refusal is (the server
            # renames it to the field the client sent).
            reason = str(error).removeprefix(f"invalid {kind}: ")
            raise InvalidRequestError(f"structured_outputs.{kind} is invalid: {reason}") from None
