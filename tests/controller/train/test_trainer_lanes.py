"""The order of a trainer's commands (controller/train/trainer_lanes.py): the critical lane goes
at once, micro-batches wait for a slot by version, then readiness."""

import asyncio

from flexmarl.controller.train.trainer_lanes import Priority, TrainerLanes


async def test_trainer_slots_send_steps_at_once_and_order_micro_batches_by_version_then_readiness():
    lanes = TrainerLanes(depth=1)
    order = []
    release_first = asyncio.Event()
    peak = 0

    async def job(name, priority, hold=None):
        nonlocal peak
        async with lanes.slot("t0", priority):
            order.append(name)
            peak = max(peak, lanes.running["t0"])
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(job("mb-a1", Priority.micro_batch(1, 1), release_first))
    await asyncio.sleep(0)
    queued = [asyncio.create_task(job(n, p)) for n, p in
              [("mb-b1", Priority.micro_batch(1, 4)), ("mb-c1", Priority.micro_batch(2, 3)),
               ("mb-p1", Priority.micro_batch(1, 2)), ("step-a", Priority.critical(1))]]
    await asyncio.sleep(0)
    assert order == ["mb-a1", "step-a"]  # the step did not wait for the slot the micro-batch holds
    release_first.set()
    await asyncio.gather(first, *queued)
    # Version first, then the micro-batch whose samples were ready first.
    assert order == ["mb-a1", "step-a", "mb-p1", "mb-b1", "mb-c1"]
    assert peak == 2 and lanes.running["t0"] == 0  # over the depth only by the step


async def test_a_waiter_cancelled_in_the_queue_takes_no_slot_with_it():
    lanes = TrainerLanes(depth=1)
    release = asyncio.Event()

    async def hold():
        async with lanes.slot("t0", Priority.micro_batch(1, 1)):
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    release.set()
    await holder
    assert lanes.running["t0"] == 0
    async with lanes.slot("t0", Priority.micro_batch(2, 1)):  # free at once: nothing waits for it
        assert lanes.running["t0"] == 1


async def test_each_trainer_has_its_own_slots():
    lanes = TrainerLanes(depth=1)
    release = asyncio.Event()

    async def hold(trainer):
        async with lanes.slot(trainer, Priority.micro_batch(1, 1)):
            await release.wait()

    held = asyncio.create_task(hold("t0"))
    await asyncio.sleep(0)
    other = asyncio.create_task(hold("t1"))
    await asyncio.sleep(0)
    assert lanes.running == {"t0": 1, "t1": 1}  # t1 did not queue behind t0's slot
    release.set()
    await asyncio.gather(held, other)
