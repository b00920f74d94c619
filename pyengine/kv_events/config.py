"""``--kv-events-config``: vLLM's ``KVEventsConfig`` keys and defaults, checked once.

Given as a JSON object (the command line), a dict (Python) or None. Unknown keys and bad
values are ``InvalidConfigError``s that name the key, so a typo in a deployment's JSON
is caught at start-up rather than silently publishing nothing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

from pyengine.errors import InvalidConfigError

_FLAG = "kv_events_config"


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how to publish KV-cache events (vLLM's names and defaults).

    - ``enable_kv_cache_events``: record and publish the prefix cache's changes.
    - ``publisher``: ``"zmq"`` (the default once enabled) or ``"null"`` (publish nothing:
      then nothing is recorded either).
    - ``endpoint``: the PUB socket; bound when it holds ``*`` or ``::`` or is ipc:// or
      inproc://, else connected (vLLM's rule). Its port is offset by the data-parallel rank.
    - ``replay_endpoint``: a ROUTER socket (bound) that resends buffered batches from a
      requested sequence number; None: no replay. Offset by the rank too.
    - ``buffer_steps``: batches kept for replay.
    - ``hwm``: the PUB socket's send high-water mark (messages zmq queues per subscriber).
    - ``max_queue_size``: batches waiting for the publisher thread; past that a batch is
      dropped (and counted), never waited for.
    - ``topic``: the first frame of every message (subscribers filter on its prefix).
    """

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        """Whether events are recorded and published (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _bad(key: str, requirement: str, value: Any) -> InvalidConfigError:
    return InvalidConfigError(f"{_FLAG}: {key!r} {requirement}, got {value!r}")


def parse_kv_events_config(value: Any) -> Optional[KVEventsConfig]:
    """``value`` (None, a JSON object as text, a dict or a ``KVEventsConfig``) checked;
    None when it is None."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidConfigError(f"{_FLAG} is not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
    if not isinstance(value, dict):
        raise InvalidConfigError(f"{_FLAG} must be a JSON object, got {value!r}")
    known = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidConfigError(f"{_FLAG}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
    checked = {**{f.name: f.default for f in dataclasses.fields(KVEventsConfig)}, **value}
    if not isinstance(checked["enable_kv_cache_events"], bool):
        raise _bad("enable_kv_cache_events", "must be true or false", checked["enable_kv_cache_events"])
    if checked["publisher"] is None:
        checked["publisher"] = "zmq" if checked["enable_kv_cache_events"] else "null"
    if checked["publisher"] not in ("zmq", "null"):
        raise _bad("publisher", "must be 'zmq' or 'null'", checked["publisher"])
    for key in ("endpoint", "topic"):
        if not isinstance(checked[key], str):
            raise _bad(key, "must be a string", checked[key])
    _check_endpoint("endpoint", checked["endpoint"])
    if checked["replay_endpoint"] is not None:
        if not isinstance(checked["replay_endpoint"], str):
            raise _bad("replay_endpoint", "must be a string or null", checked["replay_endpoint"])
        _check_endpoint("replay_endpoint", checked["replay_endpoint"])
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        v = checked[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "hwm" else 1):
            raise _bad(key, "must be an integer >= 0" if key == "hwm" else "must be an integer >= 1", v)
    return KVEventsConfig(**checked)


def _check_endpoint(key: str, endpoint: str) -> None:
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise _bad(key, "must be a tcp://, ipc:// or inproc:// address", endpoint)
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[-1]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad(key, "needs a port (tcp://HOST:PORT)", endpoint)


def check_rank_ports(config: KVEventsConfig, data_parallel_size: int) -> None:
    """With ``data_parallel_size`` cores, core ``r`` takes each tcp port plus ``r``: the
    two ranges must not overlap (``endpoint`` 5557 and ``replay_endpoint`` 5558 would give
    core 1 the port core 0 replays on)."""
    if data_parallel_size < 2 or config.replay_endpoint is None:
        return
    ports = []
    for endpoint in (config.endpoint, config.replay_endpoint):
        if not endpoint.startswith("tcp://"):
            return
        ports.append(int(endpoint.rsplit(":", 1)[1]))
    if abs(ports[0] - ports[1]) < data_parallel_size:
        raise InvalidConfigError(
            f"{_FLAG}: 'replay_endpoint' port {ports[1]} is within {data_parallel_size - 1} of 'endpoint' port "
            f"{ports[0]}: with data_parallel_size = {data_parallel_size} core r uses each port + r, so the cores' "
            "ports would collide; leave at least data_parallel_size between them")


def offset_endpoint(endpoint: Optional[str], data_parallel_rank: int) -> Optional[str]:
    """Core ``data_parallel_rank``'s address, as vLLM derives it: a tcp:// port plus the
    rank, an ipc:// or inproc:// name with ``_dp<rank>`` appended; rank 0 keeps it."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"
