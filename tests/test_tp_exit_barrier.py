"""Ranks launched from outside stop with a bounded exit: rank 0's close waits for the
workers' confirmation at most the timeout it is given (not the plan group's 30-day idle
timeout), and names the failure, when a worker heard the exit but never confirms it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pyengine.executor.tensor_parallel.broadcast_channel import BroadcastPlanSender, plan_group
from pyengine.executor.tensor_parallel.rendezvous import Rendezvous, host_store, join_group
from pyengine.models.parallel import CollectiveError

# Rank 1: joins, receives rank 0's exit, then never takes part in the exit barrier.
SILENT_WORKER = """
import sys; sys.path = [p for p in sys.path if p]  # the installed pyengine, not the checkout
import sys, time
from pyengine.executor.tensor_parallel.broadcast_channel import BroadcastPlanReceiver, plan_group
from pyengine.executor.tensor_parallel.rendezvous import Rendezvous, join_group
join_group(Rendezvous("127.0.0.1", int(sys.argv[1]), 1, 2, 1, "gloo", timeout_s=30.0))
assert BroadcastPlanReceiver(plan_group()).receive() is None
print("heard the exit", flush=True)
time.sleep(60)
"""


def test_close_waits_for_a_silent_worker_only_as_long_as_it_is_told():
    store = host_store("127.0.0.1", 0, 2, 30.0)
    worker = subprocess.Popen([sys.executable, "-c", SILENT_WORKER, str(store.port)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        join_group(Rendezvous("127.0.0.1", store.port, 0, 2, 0, "gloo", timeout_s=30.0), store)
        sender = BroadcastPlanSender(plan_group())
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="exit"):
            sender.close(timeout_s=2.0)
        assert time.monotonic() - t0 < 20
        assert worker.stdout.readline().strip() == "heard the exit"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        worker.kill()
        worker.wait(timeout=10)
