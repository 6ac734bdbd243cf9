import asyncio
import gc
import weakref

from flexmarl.runtime import collector


def test_what_is_set_apart_is_walked_by_no_collection_until_the_block_ends():
    held = [[] for _ in range(1000)]
    with collector.set_apart() as keep:
        keep()
        assert gc.get_freeze_count() >= len(held)
        gc.collect()
        assert gc.get_freeze_count() >= len(held)  # a full collection leaves them apart
    assert gc.get_freeze_count() == 0


def test_objects_frozen_before_the_block_are_left_to_whoever_froze_them():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        made = [[] for _ in range(10_000)]  # tracked, not frozen: a `keep` that froze would add them
        with collector.set_apart() as keep:
            keep()
            # Only a freeze adds to the count; another thread may free frozen objects meanwhile.
            assert gc.get_freeze_count() <= frozen
        assert gc.get_freeze_count() >= 0.9 * frozen  # an unfreeze at the block's end leaves none
        assert len(made) == 10_000
    finally:
        gc.unfreeze()


class Held:
    """Stands for an HTTP client: a cycle whose memory the collector does not count."""

    def __init__(self) -> None:
        self.me = self


def died_old() -> weakref.ref:
    """A cycle that aged into the oldest generation while in use, then died there."""
    held = Held()
    gone = weakref.ref(held)
    gc.collect(1)  # it survives the younger passes
    del held
    gc.collect(1)  # which then leave it where it is
    return gone


async def test_sweeps_free_a_cycle_that_died_in_the_oldest_generation_which_rare_passes_leave():
    with collector.rare_collections():
        sweeps = collector.Sweeps(every_s=0.05)
        sweeps.start()
        try:
            gone = died_old()
            assert gone() is not None
            running = asyncio.create_task(sweeps.run())
            for _ in range(200):
                if gone() is None:
                    break
                await asyncio.sleep(0.05)
            running.cancel()
            assert gone() is None and sweeps.count >= 1
        finally:
            sweeps.stop()


def test_sweeps_set_the_start_up_heap_apart_and_hand_it_back_but_leave_what_another_froze():
    held = [[] for _ in range(1000)]
    sweeps = collector.Sweeps()
    sweeps.start()
    assert gc.get_freeze_count() >= len(held)
    sweeps.sweep()
    assert gc.get_freeze_count() >= len(held)  # never walked again while set apart
    sweeps.stop()
    assert gc.get_freeze_count() == 0
    later = collector.Sweeps()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        later.start()
        later.stop()
        # Not handed back (an unfreeze leaves none). Equality would be fragile: a frozen object
        # that another thread frees meanwhile leaves the count too.
        assert gc.get_freeze_count() >= frozen * 0.9
    finally:
        gc.unfreeze()


async def test_swept_runs_the_loops_policy_for_the_blocks_length_and_restores_what_was_before():
    before = gc.get_threshold()
    held = [[] for _ in range(1000)]
    async with collector.swept(every_s=0.02, first_s=0.02) as sweeps:
        assert gc.get_threshold() == collector.RARE_THRESHOLDS  # until a sweep has looked
        assert gc.get_freeze_count() >= len(held)  # the heap so far set apart
        for _ in range(200):
            if sweeps.count >= 2:
                break
            await asyncio.sleep(0.02)
        assert sweeps.count >= 2  # its task sweeps on the schedule
        assert gc.get_threshold() == collector.BACKSTOP_THRESHOLDS  # they found no cycles
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    counted = sweeps.count
    await asyncio.sleep(0.1)
    assert sweeps.count == counted  # the task ended with the block


def _young_passes_over_steps(steps: int = 10, in_flight: int = 150_000) -> int:
    """Young passes while a loop's in-flight state swells and drains `steps` times (a step's
    episodes start, holding their coroutines, tasks and futures, then end), a little kept
    each step (records, counters): how a controller's heap moves at 1,024 instances."""
    passes = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 0:
            passes.append(info)

    kept = []
    gc.callbacks.append(count)
    try:
        for _ in range(steps):
            held = [[] for _ in range(in_flight)]
            kept.append([[] for _ in range(1000)])
            del held
    finally:
        gc.callbacks.remove(count)
    return len(passes)


async def test_swept_leaves_a_swelling_and_draining_in_flight_heap_to_the_sweeps_where_rare_passes_walk_it_every_step():
    with collector.rare_collections():
        gc.collect()
        rare = _young_passes_over_steps()
    assert rare >= 10  # about two a step, each walking what is in flight, collecting nothing
    async with collector.swept(every_s=3600, first_s=3600) as sweeps:  # its own sweeps come too late for this test
        sweeps.sweep()  # a sweep that finds no cycles
        swept = _young_passes_over_steps()
    assert swept == 0


def _cycles(n: int) -> None:
    """n objects in reference cycles, dropped (found only by the collector)."""
    for _ in range(n // 2):
        a: list = []
        b = [a]
        a.append(b)


async def test_a_sweep_that_finds_cycles_brings_the_young_passes_back_and_one_that_finds_none_leaves_a_backstop():
    async with collector.swept(every_s=3600, first_s=3600) as sweeps:
        sweeps.sweep()
        assert sweeps.found < collector.CYCLES_FOUND and gc.get_threshold() == collector.BACKSTOP_THRESHOLDS
        _cycles(2 * collector.CYCLES_FOUND)
        sweeps.sweep()
        assert sweeps.found >= collector.CYCLES_FOUND and gc.get_threshold() == collector.RARE_THRESHOLDS
        _cycles(collector.CYCLES_FOUND // 10)  # a few: young passes would find little of what is in flight
        sweeps.sweep()
        assert gc.get_threshold() == collector.BACKSTOP_THRESHOLDS


async def test_the_first_sweep_comes_soon_after_the_start_so_the_young_passes_are_set_early():
    with collector.rare_collections():
        sweeps = collector.Sweeps(every_s=3600, adapt=True, first_s=0.05)  # then none for an hour
        sweeps.start()
        running = asyncio.create_task(sweeps.run())
        try:
            for _ in range(100):
                if sweeps.count:
                    break
                await asyncio.sleep(0.02)
            assert sweeps.count == 1 and gc.get_threshold() == collector.BACKSTOP_THRESHOLDS
            assert collector.Sweeps().first_s < collector.Sweeps().every_s  # by default too
        finally:
            running.cancel()
            sweeps.stop()


def test_sweeps_without_adapt_leave_the_thresholds_to_their_caller():
    before = gc.get_threshold()
    sweeps = collector.Sweeps()
    _cycles(2 * collector.CYCLES_FOUND)
    sweeps.sweep()
    sweeps.sweep()
    assert sweeps.found == 0 and gc.get_threshold() == before


def test_building_in_a_process_that_owns_its_heap_sets_the_imports_then_the_build_apart(monkeypatch):
    monkeypatch.setattr(collector, "_OWNS_HEAP", True)
    before = gc.get_threshold()
    earlier = [[] for _ in range(1000)]
    gc.freeze()  # what an earlier build set apart: handed back on entry
    try:
        with collector.building() as keep:
            assert gc.get_freeze_count() == 0 and gc.get_threshold() == collector.RARE_THRESHOLDS
            imported = [[] for _ in range(1000)]
            keep()
            assert gc.get_freeze_count() >= len(earlier) + len(imported)
            built = [[] for _ in range(1000)]
        assert gc.get_freeze_count() >= len(earlier) + len(imported) + len(built)  # the build too, at its end
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()


def test_building_elsewhere_makes_the_passes_rare_and_sets_nothing_apart():
    before = gc.get_threshold()
    with collector.building() as keep:
        assert gc.get_threshold() == collector.RARE_THRESHOLDS
        keep()
        assert gc.get_freeze_count() == 0
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
