"""The producer keeps nothing of a finished episode: a run starts an episode per query per
step for as long as it runs, and what one held (its task, its context, the conversation
and what that reaches) must go when it ends, not when the run does."""

import asyncio
import gc
import weakref

from flexmarl.controller.episodes.producer import EpisodeProducer
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.schedule import BatchSchedule
from flexmarl.controller.state.store import ExperienceStore
from flexmarl.runtime.config import load_config


class Generator:
    async def generate(self, agent, group, after=""):
        return output_of([[1 + j] for j in range(group.n)], [[-1.0]] * group.n)


async def test_a_finished_episodes_context_is_freed_while_the_run_goes_on():
    steps, queries, checked = 5, 3, 3
    # At most one batch's episodes at once: while batch 3 runs, the producer is still starting
    # episodes (not yet waiting on the last ones, which holds them all).
    cfg = load_config(None, [f"run.steps={steps}", f"pipeline.queries_per_step={queries}", "agents.a.model='m'",
                             "agents.a.group_size=2", f"pipeline.max_concurrent_episodes={queries}"])
    store = ExperienceStore(["a"])
    schedule = BatchSchedule(["a"], steps, queries, overlap=True, max_staleness=steps)  # no trainer: all at version 0
    contexts: dict[int, list[weakref.ref]] = {}
    alive_when_the_last_batch_ran: list[int] = []
    tasks_kept: list[int] = []
    tasks: dict[int, list[weakref.ref]] = {}

    async def episode(ctx):
        contexts.setdefault(ctx.batch, []).append(weakref.ref(ctx))
        tasks.setdefault(ctx.batch, []).append(weakref.ref(asyncio.current_task()))
        for i, s in enumerate(await ctx.generate("a", [1, 2])):
            ctx.reward(s, float(i))
        if ctx.batch == checked:
            await asyncio.sleep(0.05)  # the first batch's episodes have all ended by now
            gc.collect()
            alive_when_the_last_batch_ran.append(sum(r() is not None for r in contexts[1]))
            tasks_kept.append(sum(r() is not None for r in tasks[1]))

    producer = EpisodeProducer(cfg, episode, store, Generator(), schedule, lambda e: None)
    await asyncio.wait_for(producer.run(), 10)
    assert len(contexts[1]) == queries and alive_when_the_last_batch_ran == [0] * queries
    assert tasks_kept == [0] * queries  # the first batch's tasks went with their episodes
