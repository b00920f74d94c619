"""The messages between a front end and its engine cores, and how they become frames.

Every message is one msgspec Struct, encoded with msgpack into the first frame of a zmq
multipart message; each numpy array inside it (a prompt's token ids, an embedding) rides
as a raw buffer frame of its own after it, referenced from the msgpack by an extension
value (index, dtype, shape). Nothing is pickled: a message from a peer can only ever
decode into these Structs, plain values and arrays.

Front end -> core (over the front end's ROUTER, one DEALER per core): ``AddRequest``,
``Abort``, ``Query``, ``Heartbeat``, ``Shutdown``. Core -> front end: ``Ready`` or
``LoadFailed`` once (on the DEALER, so the front end's ROUTER knows the core before it
sends it anything), then over a PUSH socket ``EngineCoreOutputs`` (one per engine step: every
request's output of that step, and the requests that failed), ``Status`` (a heartbeat
with the core's progress) and ``Reply`` (to a ``Query``). ``docs/multiprocess.md``
describes it for someone writing a peer.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import numpy as np

from pyengine import errors
from pyengine.errors import EngineError
from pyengine.multiprocess.wire_logprobs import WireLogprobs
from pyengine.outputs import EngineStats, ThreadStack

_ARRAY_EXT = 1  # msgpack extension code of an array reference
PROTOCOL_VERSION = 6  # in ``Ready``: front end and core must speak the same one (5: EngineCoreOutputs tag; 6: logprobs as the engine's arrays)

#: How often the front end sends each core a ``Heartbeat`` (when it has nothing else to send).
HEARTBEAT_INTERVAL_S = 1.0
#: Three missed front-end heartbeats: a remote core's death is seen, and a core whose front
#: end died exits, within 5 s (the watch adds 0.1 s and at most ``GONE_GRACE_S`` of
#: shutdown; the front end checks silence every 0.25 s). Both sides' default.
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0


# ---- front end -> core ----


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """A request, already tokenized. ``params`` is ``SamplingParams`` or ``PoolingParams``
    (``pooling`` says which) as a map of its fields: see ``params_from_builtins``."""

    request_id: str
    prompt_token_ids: Any  # np.ndarray (int64), sent as a raw buffer frame
    params: Any
    pooling: bool
    kind: str  # "delta" or "final": cumulative outputs are put together by the front end
    priority: int = 0
    # The front end makes the text from the token ids (the core sends no text): only for a
    # request whose core needs no text of its own (no stop strings), see front_text.py.
    text_in_front_end: bool = False


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Query(msgspec.Struct, tag=True, array_like=True):
    """Asks for ``what`` ("stats" or "stacks"); answered by a ``Reply`` with ``query_id``."""

    query_id: int
    what: str


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """The front end is alive (a core that hears nothing for its heartbeat timeout exits)."""


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    timeout: float = 10.0


ToCore = Union[AddRequest, Abort, Query, Heartbeat, Shutdown]


# ---- core -> front end ----


class CoreInfo(msgspec.Struct, array_like=True):
    """What the front end needs of the model, from the core that loaded it."""

    model_path: str
    max_model_len: int
    max_request_tokens: int
    vocab_size: Optional[int]
    max_logprobs: int
    tokenizer_json: Optional[str]  # tokenizers' own serialisation: the front end needs no files
    tokenizer_config: dict[str, Any]
    pid: int
    eos_token_ids: list[int] = []
    tokenizer_path: str = ""  # the tokenizer's folder when not the model's ("": the model's)
    generation_defaults: dict[str, Any] = {}  # default SamplingParams fields (EngineClient.generation_defaults)


class Ready(msgspec.Struct, tag=True, array_like=True):
    engine_index: int
    info: CoreInfo
    protocol_version: int = 0  # ``PROTOCOL_VERSION`` of the core's pyengine (0: one from before versions)


class LoadFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not start: ``error_type`` names a ``pyengine.errors`` class when it is one."""

    engine_index: int
    error_type: str
    message: str


class WireCompletion(msgspec.Struct, array_like=True):
    """One sample's part of an output (a delta unless the request asked for "final")."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[WireLogprobs]  # one position per token of ``token_ids``
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]


class WireOutput(msgspec.Struct, array_like=True):
    """One request's output of one step. The prompt is not repeated: the front end has it."""

    request_id: str
    finished: bool
    completions: list[WireCompletion]
    metrics: tuple[float, Optional[float], Optional[float], Optional[float], Optional[float], int, int]
    num_cached_tokens: int = 0
    embedding: Any = None  # np.ndarray (float32) for an embedding request
    prompt_logprobs: Optional[WireLogprobs] = None  # one position per prompt token after the first


class WireFailure(msgspec.Struct, array_like=True):
    request_id: str
    error_type: str
    message: str


class EngineCoreOutputs(msgspec.Struct, tag=True, array_like=True):
    """Everything one engine step (one output-loop event) produced, for every request."""

    engine_index: int
    outputs: list[WireOutput]
    failures: list[WireFailure] = []


class Status(msgspec.Struct, tag=True, array_like=True):
    """The core's heartbeat: its progress and, once it cannot serve, why."""

    engine_index: int
    steps: int
    num_unfinished: int
    dead_reason: Optional[str] = None


class Reply(msgspec.Struct, tag=True, array_like=True):
    engine_index: int
    query_id: int
    stats: Optional[EngineStats] = None
    stacks: Optional[list[ThreadStack]] = None
    error: Optional[str] = None


ToFrontEnd = Union[EngineCoreOutputs, Status, Reply]
Hello = Union[Ready, LoadFailed]


def core_identity(engine_index: int) -> bytes:
    """The ROUTER identity of core ``engine_index`` (its DEALER's, set before it connects)."""
    return f"core-{engine_index}".encode()


# ---- frames ----


class Codec:
    """msgpack with numpy arrays as out-of-band frames. One per socket direction and
    thread: ``encode`` and ``decode`` keep the frames of the message at hand."""

    def __init__(self, decode_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(decode_type, ext_hook=self._ext_hook)
        self._out: list[Any] = []
        self._in: list[Any] = []

    def encode(self, message: msgspec.Struct) -> list[Any]:
        """The frames of ``message``: its msgpack, then one raw buffer per array."""
        self._out = []
        try:
            head = self._encoder.encode(message)
            return [head, *self._out]
        finally:
            self._out = []

    def decode(self, frames: list[Any]) -> Any:
        self._in = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._in = []

    def _enc_hook(self, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value)
            self._out.append(memoryview(array.reshape(-1)).cast("B"))  # flat: an empty [P, 0] casts too
            meta = msgspec.msgpack.encode((len(self._out), array.dtype.str, array.shape))
            return msgspec.msgpack.Ext(_ARRAY_EXT, meta)
        if isinstance(value, Path):
            return str(value)
        raise NotImplementedError(f"cannot send a {type(value).__name__} to another process")

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _ARRAY_EXT:
            raise msgspec.ValidationError(f"unknown msgpack extension {code}")
        index, dtype, shape = msgspec.msgpack.decode(data)
        if not 0 < index < len(self._in):
            raise msgspec.ValidationError(f"array frame {index} is missing ({len(self._in)} frames)")
        frame = self._in[index]
        buffer = frame.buffer if hasattr(frame, "buffer") else frame
        return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)


def params_from_builtins(cls: type, data: dict[str, Any]) -> Any:
    """A parameters dataclass from the map of its fields, nested dataclasses included.

    Generic on purpose: a field added to ``SamplingParams`` later crosses the link with no
    new code here. (msgspec's typed decoding cannot take ``SamplingParams`` itself: its
    ``stop`` is a union of two sequence types.) A field this side does not know is an
    error, not silently dropped: front end and core must run the same version."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} must arrive as a map, got {type(data).__name__}")
    hints, known = _fields_of(cls)
    unknown = sorted(set(data) - known)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(unknown)}: front end and engine core differ")
    return cls(**{name: _field_value(hints[name], value) for name, value in data.items()})


@functools.lru_cache(maxsize=32)
def _fields_of(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """``cls``'s resolved type hints and init field names: resolving the hints costs ~0.2 ms,
    and the core would pay it again for every request it is sent."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls) if f.init)


def _field_value(annotation: Any, value: Any) -> Any:
    if isinstance(value, dict):
        for candidate in (annotation, *typing.get_args(annotation)):
            if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
                return params_from_builtins(candidate, value)
    if isinstance(value, list):
        for candidate in typing.get_args(annotation):
            args = typing.get_args(candidate)
            if typing.get_origin(candidate) is list and args and isinstance(args[0], type) \
                    and dataclasses.is_dataclass(args[0]):
                return [params_from_builtins(args[0], v) if isinstance(v, dict) else v for v in value]
    return value


def error_to_wire(error: BaseException) -> tuple[str, str]:
    """(class name, message) of an error a request or a load failed with: the nearest
    ``pyengine.errors`` class it is one of (``UnsupportedModelError`` crosses as
    ``ModelLoadError``), else its own name."""
    for cls in type(error).__mro__:
        if cls.__name__ in errors.__all__ and getattr(errors, cls.__name__) is cls:
            return cls.__name__, str(error)
    return type(error).__name__, str(error)


def error_from_wire(error_type: str, message: str) -> EngineError:
    """The ``pyengine.errors`` class named ``error_type`` (``EngineError`` for anything
    else: a peer names classes, it never builds objects here)."""
    cls = getattr(errors, error_type, None) if error_type in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, EngineError)):
        return EngineError(f"{error_type}: {message}" if error_type else message)
    return cls(message)
