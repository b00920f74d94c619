"""OS-level thread names, so ``ps -T``, ``top -H`` and py-spy show the engine's threads."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15  # linux/prctl.h
_MAX_NAME_BYTES = 15  # the kernel keeps 16 bytes including the terminating NUL


def name_current_thread(name: str) -> bool:
    """Gives the calling thread an OS-level name. Returns False where that is unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc_path = ctypes.util.find_library("c")
    if libc_path is None:
        return False
    libc = ctypes.CDLL(libc_path, use_errno=True)
    return libc.prctl(_PR_SET_NAME, name.encode()[:_MAX_NAME_BYTES], 0, 0, 0) == 0


def os_thread_names() -> list[str]:
    """Names of every thread of this process, as the OS reports them (Linux)."""
    import os

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names
