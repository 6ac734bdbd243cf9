"""The episode producer: starts every episode of every global batch, in order.

`EpisodeProducer.run()` consumes the workflow and the batch schedule; for batch t it
waits for `schedule.wait_to_start(t)` (sync mode: every agent's weights at t - 1; async
mode: at once), logs `BatchStarted` (with a dataset: which row each episode gets), then
starts the batch's `queries_per_step` episodes, at most
`max_concurrent_episodes` running at once (the bound is the semaphore below), at most
EPISODES_PER_TURN started in one turn of the event loop. Each turn
of an episode waits at the schedule's staleness gate. Produces: samples in the store
(through the episode context) and `episode_ended(t)` for every episode that ends, failed
or not (one cut short because the run stops does not end its batch: nothing trains on
what it lacks); a failed episode is counted and its groups dropped (see
workflow.run_episode). It ends when the last episode has, or raises `RunFailed` as soon
as more than `pipeline.max_failed_share` of a batch's episodes have failed (the run
cannot learn) or an episode met a failure of the run's (no rollout instance, a data field
no row has).

`EpisodeContexts` is the one place an episode context is made, for these episodes, for
held-out ones (evaluation.py) and for the calls `flexmarl serve` answers (serving.py).

It does not know trainers, weight syncs or how micro-batches are formed.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any

from flexmarl.runtime import events as ev
from flexmarl.runtime.config import ExperimentConfig

from ..control.interfaces import Emit
from ..state.failures import RunFailed, too_many_failures
from ..state.schedule import BatchSchedule
from ..state.store import ExperienceStore
from .data import Dataset
from .workflow import AgentDefaults, Episode, EpisodeContext, EpisodeEndpoint, ToolPool, run_episode

if TYPE_CHECKING:
    from ..rollout.router import RolloutClient
    from .tokens import AgentTokenizer

# Episodes started in one turn of the event loop. A batch's episodes all start at once, and
# each first turn of each branch is work of that loop turn: a thousand branches (a wide
# workflow at cluster scale) would hold the loop for a third of a second, every timer and
# reply waiting behind them. Started a few at a time, they cost nothing in order or seeds.
EPISODES_PER_TURN = 4


class EpisodeContexts:
    """What every episode of the run shares (the rollout client, the agents' sampling
    defaults, where tools run, tokenizers), and the contexts made from it."""

    def __init__(self, cfg: ExperimentConfig, client: RolloutClient, tools: ToolPool | None,
                 tokenizers: dict[str, AgentTokenizer], endpoint: EpisodeEndpoint | None = None) -> None:
        self.cfg = cfg
        self.client = client
        # Where ctx.call runs functions: environment workers, or the controller's thread pool
        self.tools = tools or ToolPool(None, cfg.pipeline.tool_timeout_s)
        self.tokenizers = tokenizers  # agent -> AgentTokenizer; filled once models are resolved
        self.endpoint = endpoint  # the run's OpenAI endpoint (openai_api.py), or None
        self.defaults = {a: AgentDefaults.of(c) for a, c in cfg.agents.items()}

    def make(self, episode_id: str, batch: int, rng: random.Random, store: ExperienceStore, item: Any, *,
             gate: Any = None, eval_temperature: float | None = None, trains: bool = True) -> EpisodeContext:
        run = self.cfg.run
        return EpisodeContext(episode_id, batch, rng, store, self.client, self.defaults, run.seed,
                              run.env_latency_ms, gate=gate, item=item,
                              tools=self.tools, tokenizers=self.tokenizers,
                              eval_temperature=eval_temperature, trains=trains, endpoint=self.endpoint)


class EpisodeProducer:
    def __init__(self, cfg: ExperimentConfig, workflow: Episode, store: ExperienceStore, client: RolloutClient,
                 schedule: BatchSchedule, emit: Emit, dataset: Dataset | None = None,
                 tools: ToolPool | None = None, tokenizers: dict[str, AgentTokenizer] | None = None,
                 endpoint: EpisodeEndpoint | None = None) -> None:
        self.cfg = cfg
        self.contexts = EpisodeContexts(cfg, client, tools, tokenizers if tokenizers is not None else {}, endpoint)
        self.emit = emit
        self.dataset = dataset  # episode g (over the run) gets row dataset.item(g)
        # Episode g of batch b, query i: `first_episode` + (b - `first_batch`) x queries + i.
        # A resumed run starts at the saved data position (`continue_data`).
        self.first_batch, self.first_episode = 1, 0
        self.workflow = workflow
        self.store = store
        self.schedule = schedule
        self.failed = 0

    async def run(self) -> None:
        """Produces every batch; the first batch with too many failed episodes stops it."""
        self._stop = asyncio.get_running_loop().create_future()
        producing = asyncio.ensure_future(self._produce())
        try:
            await asyncio.wait([producing, self._stop], return_when=asyncio.FIRST_COMPLETED)
            if self._stop.done():
                raise self._stop.exception() or asyncio.CancelledError()  # set only with an error
            await producing
        finally:
            producing.cancel()
            await asyncio.gather(producing, return_exceptions=True)

    async def _produce(self) -> None:
        p, seed = self.cfg.pipeline, self.cfg.run.seed
        limit = asyncio.Semaphore(p.max_concurrent_episodes)
        running: list[asyncio.Task] = []

        async def one(batch: int, i: int) -> None:
            failure, stopped = "", False
            try:
                g = self.episode_number(batch, i)
                ctx = self.contexts.make(f"s{batch}q{i}", batch, random.Random(f"{seed}-{batch}-{i}"), self.store,
                                         self.dataset.item(g) if self.dataset else None, gate=self.schedule.gate)
                why = await run_episode(self.workflow, ctx, p.episode_timeout_s)
                if why:
                    self.failed += 1
                    failure = f"{why}\n{ctx.failure}" if ctx.failure != why else why
            except RunFailed as exc:  # not this episode's failure: the run cannot go on
                stopped = True  # and the episode never ends: the batch is not trained on what it lacks
                self._stop_with(exc)
            except asyncio.CancelledError:  # the run is stopping: nor does an episode cut short
                stopped = True
                raise
            finally:
                limit.release()
                if not stopped:
                    self.schedule.episode_ended(batch, failure)
            if failure:
                self._check_failures(batch)

        try:
            for batch in range(self.schedule.first_batch, self.schedule.steps + 1):
                await self.schedule.wait_to_start(batch)
                self.emit(self.batch_started(batch))
                for i in range(p.queries_per_step):
                    await limit.acquire()
                    running.append(asyncio.create_task(one(batch, i), name=f"episode-s{batch}q{i}"))
                    if i % EPISODES_PER_TURN == EPISODES_PER_TURN - 1:
                        await asyncio.sleep(0)  # the rest start in later loop turns
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _check_failures(self, batch: int) -> None:
        p = self.cfg.pipeline
        progress = self.schedule.batches[batch]
        error = too_many_failures(batch, progress.episodes_failed, p.queries_per_step, p.max_failed_share,
                                  progress.first_failure)
        if error is not None:
            self._stop_with(error)

    def _stop_with(self, error: BaseException) -> None:
        """The first error that stops the run ends `run()`; later ones are dropped."""
        if not self._stop.done():
            self._stop.set_exception(error)

    def continue_data(self, batch: int, episode: int) -> None:
        """Batch `batch` starts at episode number `episode` (a resume's saved position)."""
        self.first_batch, self.first_episode = batch, episode

    def episode_number(self, batch: int, i: int) -> int:
        """Which episode of the run (and so which row of the data) query i of `batch` is."""
        return self.first_episode + (batch - self.first_batch) * self.cfg.pipeline.queries_per_step + i

    def batch_started(self, batch: int) -> ev.BatchStarted:
        q = self.cfg.pipeline.queries_per_step
        first = self.episode_number(batch, 0)
        if self.dataset is None:
            return ev.BatchStarted(batch, first)
        positions = [self.dataset.position(first + i) for i in range(q)]
        return ev.BatchStarted(batch, first, positions[0].epoch, [pos.index for pos in positions])

