"""Dynamic sampling (DAPO's): a group whose rewards are all equal is dropped before it
reaches a micro-batch, counted, and the batch draws more episodes until each agent has the
groups its regular episodes opened, up to a bound that stops the run with an error."""

import asyncio

import pytest

from flexmarl.controller.episodes.producer import EpisodeProducer
from flexmarl.controller.state import decisions
from flexmarl.controller.state.failures import RunFailed
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.schedule import BatchSchedule
from flexmarl.controller.state.store import DROPPED, READY, ExperienceStore, TurnSampling
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config
from flexmarl.runtime.keys import GroupKey


def test_a_group_of_equal_rewards_or_beyond_the_target_is_dropped_and_any_other_kept():
    assert decisions.dynamic_drop([1.0, 1.0, 1.0], kept=0, target=None) == decisions.EQUAL_REWARDS
    assert decisions.dynamic_drop([0.0, 1.0], kept=3, target=None) == ""  # the target is not known yet
    assert decisions.dynamic_drop([0.0, 1.0], kept=3, target=4) == ""
    assert decisions.dynamic_drop([0.0, 1.0], kept=4, target=4) == decisions.SURPLUS


def test_extra_episodes_come_in_waves_sized_to_refill_what_is_missing_and_never_past_the_bound():
    # 6 groups missing at 2 groups per episode: 3 episodes; another agent missing 1 at 0.5: 2
    assert decisions.extra_episodes({"a": 6, "b": 1}, {"a": 2.0, "b": 0.5}, drawn=0, bound=10) == 3
    assert decisions.extra_episodes({"a": 6}, {"a": 2.0}, drawn=9, bound=10) == 1
    assert decisions.extra_episodes({"a": 6}, {"a": 2.0}, drawn=10, bound=10) == 0
    assert decisions.extra_episodes({"a": 0, "b": -1}, {"a": 2.0, "b": 1.0}, drawn=0, bound=10) == 0


def test_the_store_drops_an_equal_group_counts_it_and_queues_the_others():
    events = []
    store = ExperienceStore(["a"], emit=events.append, dynamic=["a"])
    g0, g1 = GroupKey("e0", "a", "g0"), GroupKey("e0", "a", "g1")
    for g, rewards in ((g0, [1.0, 1.0]), (g1, [0.0, 1.0])):
        store.open_group(g, [1], 2, 1)
        store.record_group(g, output_of([[3], [4]], [[-1.0], [-1.0]], key=g), TurnSampling(0))
        store.set_group_rewards(g, rewards)
    assert store.view(g0, 0).status == DROPPED and store.view(g1, 0).status == READY
    assert store.ready_samples("a", 1) == 2 and store.groups_kept("a", 1) == 1 and store.groups_opened("a", 1) == 2
    assert store.dynamic_dropped("a", 1, decisions.EQUAL_REWARDS) == 1
    dropped = [e for e in events if isinstance(e, ev.SamplesDropped)]
    assert [(e.parts, e.why) for e in dropped] == [(ev.whole([(g0, 2)]), decisions.EQUAL_REWARDS)]


class Generator:
    """Member j of a group writes token (seed + j) % 10."""

    async def generate(self, agent, group, after=""):
        return output_of([[(group.seed + j) % 10] for j in range(group.n)], [[-1.0]] * group.n)


def producer(*overrides, equal=lambda ctx: ctx.episode_id.endswith(("q0", "q1"))):
    """Episodes of one group of `a` each; the groups of those `equal` picks have equal rewards."""
    cfg = load_config(None, ["run.steps=2", "pipeline.queries_per_step=6", "agents.a.model='m'",
                             "agents.a.dynamic_sampling=true", "agents.a.group_size=2", *overrides])
    events = []
    store = ExperienceStore(["a"], emit=events.append, dynamic=["a"])
    schedule = BatchSchedule(["a"], 2, 6, overlap=True, max_staleness=1)  # no trainer here: batch 2 plays version 0

    async def episode(ctx):
        for i, s in enumerate(await ctx.generate("a", [1, 2])):
            ctx.reward(s, 0.5 if equal(ctx) else float(i))

    return EpisodeProducer(cfg, episode, store, Generator(), schedule, events.append), store, schedule, events


async def test_a_third_of_the_groups_equal_draws_extra_episodes_until_the_batch_has_its_groups():
    made, store, schedule, events = producer()
    await asyncio.wait_for(made.run(), 10)
    for batch in (1, 2):
        assert store.groups_kept("a", batch) == 6 and schedule.rollout_complete(batch)
        assert store.ready_samples("a", batch) == 12  # the step keeps its batch size: 6 groups of 2
        assert store.dynamic_dropped("a", batch, decisions.EQUAL_REWARDS) == 2
        assert schedule.batches[batch].extra_episodes == 2
    assert [e.targets for e in events if isinstance(e, ev.GroupTargets)] == [{"a": 6}, {"a": 6}]
    assert [(e.batch, e.episodes, e.missing) for e in events if isinstance(e, ev.EpisodesDrawn)] == [
        (1, 2, {"a": 2}), (2, 2, {"a": 2})]


async def test_an_extra_episodes_groups_beyond_the_target_are_dropped_as_surplus():
    made, store, schedule, events = producer()

    async def two_groups(ctx):  # two groups per episode; q0's first has equal rewards
        for k in range(2):
            for i, s in enumerate(await ctx.generate("a", [1, 2, k])):
                ctx.reward(s, 0.5 if (ctx.episode_id.endswith("q0") and k == 0) else float(i))

    made.workflow = two_groups
    await asyncio.wait_for(made.run(), 10)
    assert store.groups_kept("a", 1) == 12 and schedule.batches[1].extra_episodes == 1  # 1 missing, 2 per episode
    assert store.dynamic_dropped("a", 1, decisions.SURPLUS) == 1 and store.ready_samples("a", 1) == 24


async def test_a_batch_that_cannot_refill_within_the_bound_stops_the_run_naming_the_agent():
    made, store, schedule, _ = producer("pipeline.max_extra_episodes=3",
                                        equal=lambda ctx: "x" in ctx.episode_id or ctx.episode_id.endswith("q0"))
    with pytest.raises(RunFailed, match=r"dynamic sampling: agent 'a' has 5 of the 6 groups step 1 trains after 3 "
                                        r"extra episodes \(pipeline.max_extra_episodes = 3\)") as caught:
        await asyncio.wait_for(made.run(), 10)
    assert "\n" not in str(caught.value)
    assert not schedule.rollout_complete(1)  # nothing trains on what the batch lacks
