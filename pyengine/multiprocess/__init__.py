"""Engine cores in processes of their own, behind one front end (``MultiprocessEngine``).

``wire`` (the messages and their frames), ``core_process`` / ``core_main`` (what runs in
a core process), ``processes`` (starting them on this host), ``streams`` (a request in
flight, as the front end sees it), ``client`` (the ``EngineClient``)."""

from pyengine.multiprocess.client import MultiprocessEngine

__all__ = ["MultiprocessEngine"]
