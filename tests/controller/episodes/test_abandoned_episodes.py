"""The producer under continuous admission with a spare: an episode still running once
every batch its bound allows is full is abandoned at once, in no batch, its samples
dropped and counted, and a fresh spare takes its place (no processes: a stand-in client,
the versions moved by hand as trainers would)."""

import asyncio
import collections

from flexmarl.controller.episodes.producer import EpisodeProducer
from flexmarl.controller.state import decisions
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.schedule import BatchSchedule
from flexmarl.controller.state.store import DROPPED, ExperienceStore
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config


class Generator:
    """Answers at once, but never for the group of episode `hangs` (a long generation)."""

    def __init__(self, hangs):
        self.hangs, self.cancelled = hangs, []

    async def generate(self, agent, group, after=""):
        if group.key.episode == self.hangs:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(group.key.episode)  # the rollout client aborts it on its instance here
                raise
        return output_of([[1 + j] for j in range(group.n)], [[-1.0]] * group.n)


async def test_an_episode_no_batch_can_train_is_abandoned_takes_no_place_and_a_fresh_spare_takes_its_own():
    steps, queries = 3, 2
    cfg = load_config(None, [f"run.steps={steps}", f"pipeline.queries_per_step={queries}", "agents.a.model='m'",
                             "agents.a.group_size=2", "pipeline.mode=async", "pipeline.max_staleness=1",
                             "pipeline.in_flight=keep", "pipeline.admission=continuous", "pipeline.partial_rollout=1"])
    events = []
    store = ExperienceStore(["a"], emit=events.append, assigned_at_end=True)
    schedule = BatchSchedule(["a"], steps, queries, overlap=True, max_staleness=1, continuous=True, spares=1)

    async def episode(ctx):
        for i, s in enumerate(await ctx.generate("a", [1, 2])):
            ctx.reward(s, float(i))

    async def train():  # each batch's rollout done: its version synced
        for batch in range(1, steps + 1):
            await schedule.batches[batch].rollout_done.wait()
            schedule.versions.set("a", batch)

    client = Generator(hangs="s1p0")
    producer = EpisodeProducer(cfg, episode, store, client, schedule, events.append)
    trainer = asyncio.ensure_future(train())
    await asyncio.wait_for(producer.run(), 10)
    await asyncio.wait_for(trainer, 1)
    # Five admitted under version 0 for batches 1 and 2 (four places and the spare); the
    # spare still ran when the fourth ended: abandoned then, its generation cancelled.
    assert [e for e in events if isinstance(e, ev.EpisodeAbandoned)] == [ev.EpisodeAbandoned("s1p0", 1, 2)]
    assert client.cancelled == ["s1p0"] and producer.abandoned == 1
    assigned = {e.episode: e.batch for e in events if isinstance(e, ev.EpisodeAssigned)}
    assert "s1p0" not in assigned and "s1p1" in assigned  # a fresh spare in its place
    assert collections.Counter(assigned.values()) == {1: 2, 2: 2, 3: 3}  # no batch lost a place to it
    dropped = [e for e in events if isinstance(e, ev.SamplesDropped)]
    assert [(e.parts.keys[0].episode, e.parts.count, e.why) for e in dropped] == [("s1p0", 2, decisions.ABANDONED)]
    assert store.count("a", DROPPED) == 2
    assert all(b.rollout_done.is_set() for b in schedule.batches.values())
