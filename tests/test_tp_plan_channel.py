"""The shared-memory plan channel on its own (one process plays rank 0 and a worker):
a plan arrives whole; a worker that finds any plan but the next one stops with a clear
error instead of running it out of step with rank 0; a polling worker gets no pipe byte,
a sleeping one is woken through its pipe; stale bytes are read off and an exit byte
among them is obeyed."""

from __future__ import annotations

import os
from multiprocessing import resource_tracker

import numpy as np
import pytest

from pyengine.executor.tensor_parallel.plan_channel import (
    EXIT_BYTE,
    STEP_BYTE,
    PlanCapacity,
    PlanSegment,
    PlanSequenceError,
    SharedMemoryPlanReceiver,
    SharedMemoryPlanSender,
    StepPipeWriter,
    StepSignal,
)
from pyengine.sampling_params import SamplingParams
from pyengine.testing.hand_plan import HandPlanner
from pyengine.testing.waits import wait_until


@pytest.fixture
def channel():
    read_fd, write_fd = os.pipe()
    owner = PlanSegment(PlanCapacity(max_tokens=64, max_rows=4, max_block_writes=64))
    attached = PlanSegment(owner.capacity, name=owner.name)
    # Attaching unregistered the name from this process's resource tracker (a worker's
    # own, in production): the owner's unlink expects it registered.
    resource_tracker.register(owner.shm._name, "shared_memory")
    pipe = StepPipeWriter(write_fd)
    sender = SharedMemoryPlanSender(owner, [pipe.send])
    receiver = SharedMemoryPlanReceiver(attached, StepSignal(read_fd))
    try:
        yield sender, receiver
    finally:
        attached.close()
        sender.close()
        pipe.close()
        os.close(read_fd)


def _plans(count: int):
    planner = HandPlanner(block_size=16, num_blocks=32, max_rows=4)
    planner.add([5, 6, 7, 8, 9], SamplingParams(temperature=0.0))
    plans = []
    for _ in range(count):
        plan = planner.next_plan()
        planner.record(plan, np.full(len(plan.sample_rows), 11, dtype=np.int64))
        plans.append(plan)
    return plans


def test_plans_arrive_in_order(channel):
    sender, receiver = channel
    for plan in _plans(3):
        ids = np.where(plan.input_ids < 0, 11, plan.input_ids)
        sender.publish(plan, ids)
        got = receiver.receive()
        assert got.step_id == plan.step_id
        np.testing.assert_array_equal(got.input_ids, ids)
        np.testing.assert_array_equal(got.positions, plan.positions)


def test_a_plan_with_per_group_tables_arrives_with_each_writes_table_and_slots():
    # A hybrid model's plan (3 tables): each block-table write's table and each token's
    # slots in tables 1.. reach the worker beside table 0's arrays.
    capacity = PlanCapacity(max_tokens=64, max_rows=4, max_block_writes=3 * 64, num_tables=3)
    owner = PlanSegment(capacity)
    attached = PlanSegment(capacity, name=owner.name)
    resource_tracker.register(owner.shm._name, "shared_memory")
    try:
        planner = HandPlanner(block_size=16, num_blocks=32, max_rows=4, tables=3)
        planner.add(list(range(5, 25)), SamplingParams(temperature=0.0))
        plan = planner.next_plan()
        owner.write(plan, plan.input_ids)
        got = attached.read()
        assert set(got.block_table_groups.tolist()) == {0, 1, 2} and len(got.group_slot_mapping) == 2 * 20
        for name in ("block_table_rows", "block_table_cols", "block_table_ids", "block_table_groups",
                     "slot_mapping", "group_slot_mapping"):
            np.testing.assert_array_equal(getattr(got, name), getattr(plan, name))
        one_table = _plans(1)[0]  # a plan with one table carries neither
        owner.write(one_table, np.where(one_table.input_ids < 0, 11, one_table.input_ids))
        got = attached.read()
        assert len(got.block_table_groups) == 0 and len(got.group_slot_mapping) == 0
        np.testing.assert_array_equal(got.block_table_ids, one_table.block_table_ids)
    finally:
        attached.close()
        owner.close()


def test_a_skipped_plan_stops_the_worker_with_a_clear_error(channel):
    sender, receiver = channel
    first, second = _plans(2)
    sender.segment.write(first, first.input_ids)  # written without a wake: the worker never saw it
    sender.publish(second, np.where(second.input_ids < 0, 11, second.input_ids))
    with pytest.raises(PlanSequenceError, match="plan sequence 2 .* expected 1"):
        receiver.receive()


def test_a_receiver_made_after_the_first_plan_still_reads_it(channel):
    """A worker builds its receiver only after its runner is ready; rank 0 may have
    published plan 1 by then (seen in the suite as "sequence 1, expected 2")."""
    sender, _ = channel
    plan = _plans(1)[0]
    ids = np.where(plan.input_ids < 0, 11, plan.input_ids)
    read_fd, write_fd = os.pipe()
    late = PlanSegment(sender.segment.capacity, name=sender.segment.name)
    resource_tracker.register(sender.segment.shm._name, "shared_memory")
    pipe = StepPipeWriter(write_fd)
    try:
        sender.segment.write(plan, ids)  # plan 1, published before the late receiver exists
        receiver = SharedMemoryPlanReceiver(late, StepSignal(read_fd))
        assert pipe.send(STEP_BYTE)
        got = receiver.receive()
        assert got is not None and got.step_id == plan.step_id
        assert np.array_equal(got.input_ids, ids)
    finally:
        late.close()
        pipe.close()
        os.close(read_fd)


def _pipe_is_empty(receiver) -> bool:
    import select

    return not select.select([receiver.signal.read_fd], [], [], 0)[0]


def test_a_polling_worker_takes_each_plan_without_a_pipe_byte(channel):
    sender, receiver = channel
    for plan in _plans(3):
        sender.publish(plan, np.where(plan.input_ids < 0, 11, plan.input_ids))
        assert _pipe_is_empty(receiver), "rank 0 wrote the pipe of a worker that was not asleep"
        got = receiver.receive()
        assert got is not None and got.step_id == plan.step_id


def test_a_sleeping_worker_is_woken_through_its_pipe(channel):
    import threading

    sender, receiver = channel
    receiver.poll_s = 0.001
    plan = _plans(1)[0]
    got = []
    thread = threading.Thread(target=lambda: got.append(receiver.receive()))
    thread.start()
    try:
        wait_until(lambda: sender.segment.asleep[0], 10, interval=0.005)  # polled, then went to sleep
        assert sender.segment.asleep[0] == 1
        sender.publish(plan, np.where(plan.input_ids < 0, 11, plan.input_ids))
        thread.join(10)
    finally:
        if thread.is_alive():
            sender.wakes[0](EXIT_BYTE)
            thread.join(10)
    assert got and got[0] is not None and got[0].step_id == plan.step_id
    assert sender.segment.asleep[0] == 0


def test_stale_bytes_are_read_off_and_an_exit_among_them_is_obeyed(channel):
    sender, receiver = channel
    first, second = _plans(2)
    for byte in (STEP_BYTE, STEP_BYTE, EXIT_BYTE):  # wakes of plans taken by polling, then the exit
        sender.wakes[0](byte)
    sender.publish(first, np.where(first.input_ids < 0, 11, first.input_ids))
    got = receiver.receive()
    assert got is not None and got.step_id == first.step_id
    assert _pipe_is_empty(receiver)
    assert receiver.receive() is None
