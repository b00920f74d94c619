"""Type stubs for ``pyengine._native``, the one native extension (``rust_sched/python``).

Loading it registers the modules ``pyengine._sched`` (the scheduler) and
``pyengine._kernels`` (the executor's CPU kernels); import those, not this.
"""

from types import ModuleType
from typing import Final

__all__ = ["__version__", "_kernels", "_sched"]

__version__: Final[str]
_sched: ModuleType
_kernels: ModuleType
