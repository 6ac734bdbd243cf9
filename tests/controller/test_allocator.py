from flexmarl.controller.allocator import choose_placement

TRAINERS = ["t0", "t1"]


def test_free_slot_goes_to_the_least_loaded_trainer():
    assert choose_placement("c", TRAINERS, 2, {"a": "t0"}, {}, {}, {}) == ("t1", None)


def test_unlimited_capacity_never_parks_anyone():
    resident = {"a": "t0", "b": "t1", "c": "t0"}
    assert choose_placement("d", TRAINERS, 0, resident, {}, {}, {}) == ("t1", None)


def test_full_pool_parks_the_idle_agent_with_least_ready_work():
    resident = {"a": "t0", "b": "t1"}
    assert choose_placement("c", TRAINERS, 1, resident, {}, {"a": 5, "b": 1}, {}) == ("t1", "b")


def test_an_agent_with_work_in_flight_is_never_parked():
    resident = {"a": "t0", "b": "t1"}
    assert choose_placement("c", TRAINERS, 1, resident, {"b": 1}, {"a": 5, "b": 0}, {}) == ("t0", "a")
    assert choose_placement("c", TRAINERS, 1, resident, {"a": 1, "b": 2}, {}, {}) is None


def test_ties_go_to_the_longest_unused_agent():
    resident = {"a": "t0", "b": "t1"}
    assert choose_placement("c", TRAINERS, 1, resident, {}, {}, {"a": 10.0, "b": 5.0}) == ("t1", "b")


async def test_trainer_slots_let_steps_pass_queued_micro_batches_and_keep_order_otherwise():
    import asyncio

    from flexmarl.controller.allocator import TrainerAllocator

    alloc = TrainerAllocator(None, ["t0"], 0, {}, {}, 0, lambda a: 0, lambda e: None)
    alloc.depth = 1
    order = []
    release_first = asyncio.Event()

    async def job(name, priority, hold=None):
        async with alloc.slot("t0", priority):
            order.append(name)
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(job("mb-a1", (1, 1), release_first))
    await asyncio.sleep(0)
    queued = [asyncio.create_task(job(n, p)) for n, p in
              [("mb-b1", (1, 1)), ("mb-b2", (1, 1)), ("step-a", (0, 1)), ("mb-c1", (1, 2))]]
    await asyncio.sleep(0)
    release_first.set()
    await asyncio.gather(first, *queued)
    assert order == ["mb-a1", "step-a", "mb-b1", "mb-b2", "mb-c1"]
    assert alloc._running["t0"] == 0
