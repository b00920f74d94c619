"""The command line of one of pyengine's own Python child processes.

``python -m MODULE`` (and ``python -c``) put the current folder first on ``sys.path``.
Started from a source checkout (the tests run from the repository root, as CI runs
them against the installed wheel), the child would then import the checkout's
``pyengine/``, which holds no native module, instead of the installed package. The
command here runs the module with the current folder left off ``sys.path``, as
``python -P -m`` does on Python 3.11 and later (we support 3.10).
"""

from __future__ import annotations

import sys

_RUN_MODULE = (
    "import runpy, sys; sys.path = [p for p in sys.path if p]; "
    "module = sys.argv.pop(1); runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def python_module_command(module: str, *args: str) -> list[str]:
    """``python -m module args...`` for a child, without the current folder on its path."""
    return [sys.executable, "-c", _RUN_MODULE, module, *args]
