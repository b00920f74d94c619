"""The start-up heap freeze of pyengine's own processes (server, engine core, TP worker):
what was alive is out of the collector's full passes, what comes later is still collected.
Run in a child interpreter: freezing pytest's own heap would keep its garbage forever."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import sys
sys.path = [p for p in sys.path if p]  # the installed pyengine, not the checkout (see child_command)
import gc
from pyengine.processes.startup_heap import freeze_startup_heap

class Node:
    pass

kept = [Node() for _ in range(1000)]
before = gc.get_freeze_count()
freeze_startup_heap()
frozen = gc.get_freeze_count()
assert before == 0 and frozen >= 1000, (before, frozen)

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a

for _ in range(50):
    cycle()
collected = gc.collect()
assert collected >= 100, collected  # garbage made after the freeze is still reclaimed
assert gc.get_freeze_count() == frozen  # and the frozen objects were not walked back in
print("ok")
"""


def test_freeze_keeps_startup_objects_out_and_collects_later_garbage():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
