"""``make_engine_client``: the one way to build an ``EngineClient`` of either kind.

In-process (``AsyncEngine``: the engine's threads in this process) or multi-process
(``MultiprocessEngine``: engine cores in processes of their own, what ``pyengine serve``
runs; ``data_parallel_size`` > 1 needs it). ``pyengine serve``, the tests and programs that
want the engine core out of their process all come here, so the choice and the link's
options (``LinkOptions``) are made in one place.
"""

from __future__ import annotations

import threading
from typing import Optional

from pyengine.config import EngineConfig
from pyengine.entrypoints.engine_client import EngineClient
from pyengine.errors import InvalidConfigError
from pyengine.multiprocess.link_options import LinkOptions


def make_engine_client(config: EngineConfig, *, multiprocess: bool = False, link: Optional[LinkOptions] = None,
                       abandon: Optional[threading.Event] = None) -> EngineClient:
    """An ``AsyncEngine`` for ``config`` (``multiprocess=False``), or a
    ``MultiprocessEngine`` reaching its cores as ``link`` says (default ``LinkOptions()``:
    every core on this host, over ipc://). ``abandon``, set by another thread or a signal
    handler, ends a multi-process start-up that is still waiting for its cores (its
    processes killed and reaped, ``EngineError`` raised)."""
    if not multiprocess:
        if link is not None or abandon is not None:
            raise InvalidConfigError("link options and abandon are for multiprocess=True: an in-process engine "
                                     "has no engine-core processes")
        from pyengine.entrypoints.async_engine import AsyncEngine

        return AsyncEngine.from_config(config)
    from pyengine.multiprocess.client import MultiprocessEngine

    return MultiprocessEngine(config, link or LinkOptions(), abandon=abandon)


__all__ = ["LinkOptions", "make_engine_client"]
