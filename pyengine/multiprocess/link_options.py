"""``LinkOptions``: how a front end reaches its engine cores, defined once.

``MultiprocessEngine`` takes them, ``make_engine_client`` passes them on, and
``pyengine serve``'s flags (``add_link_flags``, read back by ``link_options``) are made from
the table below, so a name, a default or a meaning lives in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from pyengine.errors import InvalidConfigError
from pyengine.multiprocess.wire import DEFAULT_HEARTBEAT_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class LinkOptions:
    """- ``transport``: "ipc" (sockets in a private temporary folder) or "tcp" (``host`` and
      ``input_port`` / ``output_port``; 0 picks free ports).
    - ``local_cores``: how many cores to start here (default all); the others are started
      on other hosts with ``pyengine core`` and connect to the tcp addresses.
    - ``core_cpus``: the CPUs the local cores split among themselves (default: no pinning
      for one core, this process's CPUs for several).
    - ``start_timeout``: seconds to wait for every core's ``Ready``.
    - ``heartbeat_timeout``: a core exits after this long without a word from the front
      end; a core on another host is declared dead after this long without a ``Status``."""

    transport: str = "ipc"
    host: str = "127.0.0.1"
    input_port: int = 0
    output_port: int = 0
    local_cores: Optional[int] = None
    core_cpus: Optional[tuple[int, ...]] = None
    start_timeout: float = 600.0
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.transport not in ("ipc", "tcp"):
            raise InvalidConfigError(f"transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.core_cpus is not None:
            object.__setattr__(self, "core_cpus", tuple(int(c) for c in self.core_cpus))
        for name in ("start_timeout", "heartbeat_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")


# (field, flag, help) of ``pyengine serve``'s link flags; types and defaults from LinkOptions.
LINK_FLAGS = (
    ("transport", "--engine-transport", "ipc:// sockets in a private temporary folder, or tcp:// (cores on "
     "other hosts)"),
    ("host", "--engine-host", "the address the tcp:// sockets listen on"),
    ("input_port", "--engine-input-port", "tcp:// command port (0: a free one)"),
    ("output_port", "--engine-output-port", "tcp:// output port (0: a free one)"),
    ("local_cores", "--local-engine-cores", "cores started here (default: all of --data-parallel-size); the rest "
     "run `pyengine core` on other hosts"),
    ("core_cpus", "--engine-core-cpus", "CPU ids (e.g. 0,1) the local cores split among them (default: no "
     "pinning for one core, this process's CPUs for several)"),
    ("start_timeout", "--engine-start-timeout", "seconds to wait for every engine core to load (default: "
     "%(default)s)"),
    ("heartbeat_timeout", "--engine-heartbeat-timeout", "seconds without a word after which a core and its front "
     "end count each other gone (default: %(default)s)"),
)


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of CPU ids, got {text!r}") from None


def add_link_flags(parser: argparse.ArgumentParser) -> None:
    """The ``engine-core processes`` flag group (``--engine-transport`` ...)."""
    defaults = {f.name: f.default for f in dataclasses.fields(LinkOptions)}
    group = parser.add_argument_group("engine-core processes (docs/multiprocess.md)")
    for name, flag, text in LINK_FLAGS:
        default = defaults[name]
        if name == "transport":
            group.add_argument(flag, dest=_dest(name), choices=("ipc", "tcp"), default=default, help=text)
        elif name == "core_cpus":
            group.add_argument(flag, dest=_dest(name), type=_cpu_list, default=None, metavar="LIST", help=text)
        elif name == "local_cores":
            group.add_argument(flag, dest=_dest(name), type=int, default=None, metavar="N", help=text)
        else:
            group.add_argument(flag, dest=_dest(name), type=type(default), default=default, help=text)


def link_options(ns: argparse.Namespace) -> LinkOptions:
    """``LinkOptions`` from the flags ``add_link_flags`` added."""
    return LinkOptions(**{name: getattr(ns, _dest(name)) for name, _, _ in LINK_FLAGS})


def _dest(name: str) -> str:
    """The namespace attribute of a link flag (``host`` alone is the HTTP server's)."""
    return f"link_{name}"
