"""The batch schedule on its own: start rule, staleness gate, wake-ups, progress records."""

import asyncio

from flexmarl.controller.state import decisions
from flexmarl.controller.state.schedule import BatchSchedule


def schedule(overlap=False, k=0, steps=3, episodes=2):
    clock = iter(range(100))
    return BatchSchedule(["a", "b"], steps, episodes, overlap=overlap, max_staleness=k, clock=lambda: next(clock))


async def test_sync_mode_starts_a_batch_only_when_every_agent_has_synced_the_previous_one():
    s = schedule(overlap=False)
    await asyncio.wait_for(s.wait_to_start(1), 1)
    waiter = asyncio.ensure_future(s.wait_to_start(2))
    s.versions.set("a", 1)
    await asyncio.sleep(0.01)
    assert not waiter.done()
    s.versions.set("b", 1)
    await asyncio.wait_for(waiter, 1)
    assert s.batches[2].started is not None


async def test_async_mode_starts_at_once_and_the_gate_holds_turns_past_the_bound():
    s = schedule(overlap=True, k=1)
    await asyncio.wait_for(s.wait_to_start(3), 1)
    await asyncio.wait_for(s.gate("a", 2), 1)  # batch 2 may use version 0 with k = 1
    gated = asyncio.ensure_future(s.gate("a", 3))  # batch 3 needs version >= 1
    await asyncio.sleep(0.01)
    assert not gated.done()
    s.versions.set("b", 1)  # another agent's version does not open a's gate
    await asyncio.sleep(0.01)
    assert not gated.done()
    s.versions.set("a", 1)
    await asyncio.wait_for(gated, 1)


async def test_the_last_episode_of_a_batch_completes_its_rollout_and_wakes_every_pipeline():
    s = schedule(episodes=2)
    waiters = [asyncio.ensure_future(s.wait_for_work(a)) for a in ("a", "b")]
    s.episode_ended(1)
    await asyncio.sleep(0.01)
    assert not s.rollout_complete(1) and not any(w.done() for w in waiters)
    s.episode_ended(1)
    await asyncio.wait_for(asyncio.gather(*waiters), 1)
    assert s.rollout_complete(1) and s.batches[1].rollout_end is not None


async def test_work_arriving_wakes_only_that_agents_pipeline():
    s = schedule()
    a, b = asyncio.ensure_future(s.wait_for_work("a")), asyncio.ensure_future(s.wait_for_work("b"))
    s.work_arrived("a")
    await asyncio.wait_for(a, 1)
    await asyncio.sleep(0.01)
    assert not b.done()
    b.cancel()


async def test_a_turn_waiting_at_the_gate_wakes_on_its_own_agents_sync_only(monkeypatch):
    s = schedule(overlap=True, k=0)
    checks, rule = [], decisions.may_generate
    monkeypatch.setattr(decisions, "may_generate", lambda *args: checks.append(args) or rule(*args))
    waiter = asyncio.ensure_future(s.gate("a", 2))  # batch 2 at K = 0 needs a's version 1
    await asyncio.sleep(0.01)
    for version in (1, 2, 3):  # other agents' syncs
        s.versions.set("b", version)
        await asyncio.sleep(0.01)
    assert not waiter.done() and checks == [(2, 0, 0)]
    s.versions.set("a", 1)
    await asyncio.wait_for(waiter, 1)
    assert checks == [(2, 0, 0), (2, 1, 0)]


def test_a_batch_is_trained_when_its_last_agent_steps_and_the_run_when_every_batch_is():
    s = schedule(steps=1)
    s.batches[1].started = 0.0
    s.episode_ended(1)
    s.episode_ended(1)
    assert s.agent_stepped(1) is False and not s.finished
    assert s.agent_stepped(1) is True and s.finished
    # the test clock ticks 0, 1, ...: the rollout ended at 0 (started at 0), trained at 1
    assert s.stage_times() == {"rollout_s": 0.0, "train_sync_s": 1.0}


def with_roles(overlap=False, k=0):
    """a trained; s a snapshot of it refreshed every 2 steps; j frozen."""
    return BatchSchedule(["a"], 6, 1, overlap=overlap, max_staleness=k, snapshots={"s": 2},
                         versions=decisions_versions())


def decisions_versions():
    from flexmarl.controller.state.versions import SyncedVersions
    return SyncedVersions(["a", "s", "j"])


async def test_a_frozen_agent_never_waits_and_a_snapshot_waits_for_its_refresh():
    s = with_roles()
    await asyncio.wait_for(s.gate("j", 6), 1)  # frozen: no policy being trained, nothing to wait for
    await asyncio.wait_for(s.gate("s", 2), 1)  # batch 2 plays the snapshot of version 0
    gated = asyncio.ensure_future(s.gate("s", 3))  # batch 3 plays version 2's
    s.versions.set("a", 2)  # the source's sync alone does not open it
    await asyncio.sleep(0.01)
    assert not gated.done()
    s.versions.set("s", 2)
    await asyncio.wait_for(gated, 1)
    s.versions.set("j", 0)
    assert decisions.snapshot_version(5, 2) == 4 and decisions.snapshot_version(4, 2) == 2


async def test_sync_mode_starts_a_batch_once_the_trained_agents_synced_whatever_the_frozen_hold():
    s = with_roles()
    s.versions.set("a", 1)
    await asyncio.wait_for(s.wait_to_start(2), 1)  # the snapshot is still at 0, the frozen agent always
    assert s.agent_stepped(1)  # one trained agent: its step ends the batch



async def test_continuous_admission_gives_an_instance_more_work_before_the_version_moves():
    """Two episodes a batch, K = 1, version 0: batches 1 and 2 may generate, batch 3 needs
    version 1. Under step admission an episode of batch 3 waits for the sync; under
    continuous admission with one spare it is admitted at once (five running for the four
    batches 1 and 2 train), and a sixth waits for the version to move."""
    for continuous in (False, True):
        s = BatchSchedule(["a"], 4, 2, overlap=True, max_staleness=1, continuous=continuous, spares=1)
        running = [s.slot(b) for b in (1, 1, 2, 2)]
        for slot in running:
            await asyncio.wait_for(s.gate_of(slot)("a", slot.started), 1)
        fifth = asyncio.ensure_future(s.gate_of(s.slot(3))("a", 3))
        await asyncio.sleep(0.01)
        assert fifth.done() is continuous and s.versions["a"] == 0
        fifth.cancel()
    sixth = asyncio.ensure_future(s.gate_of(s.slot(3))("a", 3))
    await asyncio.sleep(0.01)
    assert not sixth.done()
    s.versions.set("a", 1)  # batch 3 opens: two more slots
    await asyncio.wait_for(sixth, 1)


async def test_continuous_admission_fills_a_batch_by_the_first_episodes_to_end_and_carries_the_slowest():
    s = BatchSchedule(["a"], 3, 2, overlap=True, max_staleness=1, continuous=True, spares=1)
    slots = [s.slot(1) for _ in range(3)] + [s.slot(2) for _ in range(2)]
    for slot in slots:
        await asyncio.wait_for(s.gate_of(slot)("a", slot.started), 1)
    ended = [s.assign(slots[i]) for i in (3, 1)]  # a batch-2 one and one of batch 1 end first
    assert ended == [1, 1]
    for batch in ended:
        s.episode_ended(batch)
    assert s.rollout_complete(1)  # it does not wait for slots 0 and 2: they carry over
    assert s.assign(slots[0]) == 2 and s.assign(slots[2]) == 2
    # The last batch trains every episode left: its two and the spare.
    assert s.batches[3].episodes_left == 3
    assert decisions.assigned_batch({1: 2, 2: 2}, {}, 1, 3, 2) == 3 == decisions.assigned_batch({1: 2, 2: 2, 3: 5}, {}, 1, 3, 2)
    assert decisions.may_admit(4, {1: 1}, 1, 2, 3, 2, 1) is False  # 4 running + 1 ended fill 2 x 2 + 1
    assert decisions.may_admit(3, {1: 1}, 1, 2, 3, 2, 1) is True


def test_a_newer_episode_ending_first_never_takes_the_place_an_older_one_needs_within_its_bound():
    # Two a batch, K = 1: batch 1 trained two. Two episodes admitted under version 0 (due by
    # batch 2) still run; one admitted under version 1 (due by 3) ends first.
    assert decisions.assigned_batch({1: 2}, {2: 2}, 1, 5, 2) == 3  # batch 2 is theirs
    assert decisions.assigned_batch({1: 2}, {2: 1}, 1, 5, 2) == 2  # room for both
    assert decisions.assigned_batch({1: 2}, {2: 2}, 1, 5, 2, spares=1) == 2  # a spare may take it
    assert decisions.assigned_batch({}, {1: 1, 2: 2}, 1, 5, 2) == 1  # one of batch 1's own, the others fit
    # One that already missed its bound (batches up to 2 full) takes no spare's room: it goes after them.
    assert decisions.assigned_batch({1: 2, 2: 2}, {3: 2}, 1, 6, 2, spares=1, newest=2) == 4
    assert decisions.assigned_batch({1: 2, 2: 2}, {3: 2}, 1, 6, 2, spares=1, newest=3) == 3


async def test_capacity_admission_spends_a_spare_only_on_a_drained_instance_one_per_instance():
    """Two episodes a batch, K = 1, two spares, version 0: batches 1 and 2 hold four. Past
    them continuous admission admits both spares at once; capacity admission admits one
    only while an instance of the agent has no group left, one per such instance."""
    drained = {"a": 0}
    s = BatchSchedule(["a"], 4, 2, overlap=True, max_staleness=1, continuous=True, spares=2,
                      drained=drained.__getitem__)
    admitted = []
    for b in (1, 1, 2, 2):  # within the bound: never held back, whatever the instances hold
        slot = s.slot(b)
        await asyncio.wait_for(s.gate_of(slot, admitted.append)("a", b), 1)
    assert [slot.drained for slot in admitted] == [0, 0, 0, 0]
    fifth, sixth = s.slot(3), s.slot(3)
    waiting = [asyncio.ensure_future(s.gate_of(slot, admitted.append)("a", 3)) for slot in (fifth, sixth)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiting)  # every instance busy: no spare spent
    drained["a"] = 1
    s.instance_drained("r0")
    await asyncio.sleep(0.01)
    assert sum(w.done() for w in waiting) == 1 and admitted[-1].drained == 1  # one, for the drained one
    drained["a"] = 2
    s.instance_drained("r1")
    await asyncio.wait_for(asyncio.gather(*waiting), 1)
    assert [slot.drained for slot in admitted[4:]] == [1, 2]
    assert [decisions.spare_room(2, d) for d in (None, 0, 1, 5)] == [2, 0, 1, 2]
    # The rule's count: four running fill batches 1 and 2; a spare only with room for it.
    assert decisions.may_admit(4, {}, 1, 2, 4, 2, decisions.spare_room(2, 0)) is False
    assert decisions.may_admit(4, {}, 1, 2, 4, 2, decisions.spare_room(2, 1)) is True
    assert decisions.may_admit(5, {}, 1, 2, 4, 2, decisions.spare_room(2, 1)) is False


def test_an_episode_is_doomed_once_every_batch_before_the_last_that_its_bound_allows_is_full():
    # Two a batch, five batches: the newest batch B before the last whose batches from the
    # first on are all full.
    assert decisions.doomed_through({}, 1, 5, 2) == 0
    assert decisions.doomed_through({1: 2, 2: 1}, 1, 5, 2) == 1
    assert decisions.doomed_through({1: 2, 2: 1, 3: 2}, 1, 5, 2) == 1  # a later full batch does not count past a gap
    assert decisions.doomed_through({1: 2, 2: 2, 3: 2, 4: 2, 5: 9}, 1, 5, 2) == 4  # never the last
    assert decisions.doomed_through({3: 2}, 3, 6, 2) == 3 and decisions.doomed_through({}, 3, 6, 2) == 2  # resumed
    # No first turn is admitted into a bound already full (spares or not); one batch on, it is.
    assert decisions.may_admit(0, {1: 2, 2: 2}, 1, 2, 4, 2, 5) is False
    assert decisions.may_admit(0, {1: 2, 2: 2}, 1, 3, 4, 2, 5) is True


async def test_a_running_episode_leaves_its_slot_exactly_when_the_batches_its_bound_allows_are_full():
    """Two a batch, K = 1, one spare, version 0: five admitted, each may train in batches 1
    or 2. Only once both are full is the one still running doomed; its place frees, but a
    first turn waiting for it is held until the version moves (its bound would be full)."""
    s = BatchSchedule(["a"], 4, 2, overlap=True, max_staleness=1, continuous=True, spares=1)
    slots = [s.slot(b) for b in (1, 1, 2, 2, 1)]
    for slot in slots:
        await asyncio.wait_for(s.gate_of(slot)("a", slot.started), 1)
    assert [slot.admitted for slot in slots] == [2] * 5
    waiting = asyncio.ensure_future(s.gate_of(s.slot(3))("a", 3))
    for i, batch in zip((0, 1, 2), (1, 1, 2)):
        assert s.assign(slots[i]) == batch
        assert s.doomed() == []  # a batch its bound allows still has room
    assert s.assign(slots[3]) == 2
    assert s.doomed() == [slots[4]] and slots[4].doomed  # batches 1 and 2 full: it can only be dropped
    assert s.doomed() == []  # once
    await asyncio.sleep(0.01)
    assert not waiting.done()  # batches up to 2 full: admitting it would doom it at once
    s.versions.set("a", 1)
    await asyncio.wait_for(waiting, 1)
    assert s.batches[4].episodes_left == 3  # the last batch still counts the spare: a fresh one replaces it


async def test_no_episode_is_doomed_under_step_admission_nor_one_the_last_batch_may_train():
    step = BatchSchedule(["a"], 3, 2, overlap=True, max_staleness=1)
    await asyncio.wait_for(step.gate_of(step.slot(1))("a", 1), 1)
    assert step.doomed() == []
    # Two batches, K = 1: every episode's bound reaches the last batch, which trains all that is left.
    s = BatchSchedule(["a"], 2, 2, overlap=True, max_staleness=1, continuous=True, spares=2)
    slots = [s.slot(1) for _ in range(6)]
    for slot in slots:
        await asyncio.wait_for(s.gate_of(slot)("a", 1), 1)
    assert [s.assign(slot) for slot in slots[:4]] == [1, 1, 2, 2]
    assert s.doomed() == [] and not any(slot.doomed for slot in slots)
