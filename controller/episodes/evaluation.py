"""Evaluation: held-out episodes every `eval.every` optimizer steps, never trained.

`Evaluator.run()` consumes the batch schedule (it waits until every agent has stepped and
synced batch t, for each evaluation step t) and produces one metrics row per agent per
evaluation (`"kind": "eval"`), an `EvaluationDone` event and a progress line. Each
evaluation runs `eval.episodes` episodes of the run's workflow over the eval rows
(`data.eval`, in file order, cycled; without it, the workflow's own queries from a fixed
seed, the same at every evaluation), at `eval.temperature` (greedy by default) with one
sample per call. Its samples live in a store of their own that nothing trains from.

An evaluation after step t measures version t of every agent: the schedule holds each
agent's sync to version t + 1 until the evaluation has run (later batches may roll out and
train meanwhile, in async mode), and each row records the versions every agent's samples
ran under (`versions`).

It does not know trainers or how micro-batches are formed.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any

from flexmarl.runtime import events as ev
from flexmarl.runtime.config import ExperimentConfig

from ..control.interfaces import Emit
from ..state.schedule import BatchSchedule
from ..state.store import ExperienceStore
from .data import Dataset
from .producer import EpisodeContexts
from .workflow import Episode, EpisodeEndpoint, ToolPool, run_episode

if TYPE_CHECKING:
    from ..records.metrics import MetricsLog
    from ..rollout.router import RolloutClient
    from .tokens import AgentTokenizer


def evaluation_steps(every: int, steps: int, at_start: bool) -> list[int]:
    if every <= 0:
        return []
    points = list(range(every, steps + 1, every))
    if points[-1:] != [steps]:
        points.append(steps)  # always evaluate the final weights
    return ([0] if at_start else []) + points


class Evaluator:
    def __init__(self, cfg: ExperimentConfig, workflow: Episode, client: RolloutClient, schedule: BatchSchedule,
                 metrics: MetricsLog, emit: Emit, dataset: Dataset | None,
                 tools: ToolPool | None = None, tokenizers: dict[str, AgentTokenizer] | None = None,
                 endpoint: EpisodeEndpoint | None = None) -> None:
        self.cfg = cfg
        self.contexts = EpisodeContexts(cfg, client, tools, tokenizers if tokenizers is not None else {}, endpoint)
        self.workflow = workflow
        self.schedule = schedule
        self.metrics = metrics
        self.emit = emit
        self.dataset = dataset
        self.results: list[dict[str, Any]] = []
        e = cfg.eval
        # Done before the run resumed: not again.
        self.steps = [t for t in evaluation_steps(e.every, cfg.run.steps, e.at_start) if t >= schedule.first_batch - 1]
        for step in self.steps:  # from now on, no agent moves past a version still to be evaluated
            schedule.evaluation_at(step)

    async def run(self) -> None:
        for step in self.steps:
            if step > 0:
                await self.schedule.wait_trained(step)
            await self.evaluate(step)
            self.schedule.evaluated(step)

    async def evaluate(self, step: int) -> list[dict[str, Any]]:
        e, seed = self.cfg.eval, self.cfg.run.seed
        store = ExperienceStore(list(self.cfg.agents))  # nothing is ever taken from it
        limit = asyncio.Semaphore(self.cfg.pipeline.max_concurrent_episodes)
        failed = 0

        async def one(i: int) -> None:
            nonlocal failed
            async with limit:
                ctx = self.contexts.make(f"eval{step}q{i}", step + 1, random.Random(f"eval-{seed}-{i}"), store,
                                         self.dataset.item(i) if self.dataset else None,
                                         eval_temperature=e.temperature)
                if await run_episode(self.workflow, ctx, self.cfg.pipeline.episode_timeout_s):
                    failed += 1

        await asyncio.gather(*(one(i) for i in range(e.episodes)))
        kept = {a: store.kept_views(a) for a in self.cfg.agents}
        versions = {a: sorted({v for s in samples for v in s.versions}) for a, samples in kept.items()}
        rows = [self.metrics.record_eval(step, agent, samples, failed, e.episodes, versions)
                for agent, samples in kept.items()]
        self.emit(ev.EvaluationDone(step, e.episodes, failed,
                                    {r["agent"]: r["reward_mean"] for r in rows if r["reward_mean"] is not None}))
        self.metrics.eval_line(step, rows)
        self.results += rows
        return rows
