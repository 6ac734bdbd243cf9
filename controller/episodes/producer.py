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

With dynamic sampling (`agents.*.dynamic_sampling`), each batch is held open (`_top_up`)
after its regular episodes end: each such agent's target is the groups those episodes
opened (`GroupTargets`); while an agent has fewer trainable ones (the store dropped those
whose rewards were all equal), more episodes of the batch are drawn, in waves sized by
`decisions.extra_episodes` (`EpisodesDrawn`), up to `pipeline.max_extra_episodes`, past
which the run stops with an error naming the agent. An extra episode is `s{batch}x{j}`,
seeded by its name, and takes its data row after every regular episode's rows.

With continuous admission (`pipeline.admission`), each episode's turns wait at the gate
the schedule gives its `EpisodeSlot`, and when it ends the schedule names the batch that
trains it (`EpisodeAdmitted`, `EpisodeAssigned`; the store moves its groups there) before that batch counts
it; `pipeline.partial_rollout` spare episodes (`s{first}p{j}`, rows after every regular
and extra one) start with the first batch. A running episode that no batch can train any
more (every batch its bound allows is full: `BatchSchedule.doomed`) is abandoned at once
(`EpisodeAbandoned`): its task is cancelled, which aborts its requests in the engines, its
groups are dropped, it is in no batch, and a fresh spare is begun in its place.

It does not know trainers, weight syncs or how micro-batches are formed.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

from flexmarl.runtime import events as ev
from flexmarl.runtime.config import ExperimentConfig

from ..control.interfaces import Emit
from ..state import decisions
from ..state.failures import RunFailed, too_many_failures
from ..state.schedule import BatchSchedule, EpisodeSlot
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


@dataclass
class BegunEpisode:
    """An episode the producer started that no trained batch has taken yet: what a
    checkpoint records of it, and what a resume starts again (same name, seed and row)."""

    name: str
    started: int  # the batch it started as one of
    kind: str  # "q" regular, "p" a spare (partial rollout)
    index: int
    number: int  # its episode number over the run, so its dataset row
    assigned: int | None = None  # the batch that trains it, once it ended


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
        self.dynamic = [a for a, c in cfg.agents.items() if c.dynamic_sampling]
        # The episodes begun and not yet taken by a trained batch, in the order they began
        # (`in_flight`); the next regular episode to begin, (batch, query); the spares begun.
        # A resume starts `_redrawn` again first (`redraw`), then goes on from `_next`.
        self._begun: dict[str, BegunEpisode] = {}
        self._ended_in: dict[int, list[str]] = {}  # batch -> the begun episodes it trains
        self._pruned = 0  # the batches up to this one are trained: their episodes left `_begun`
        self._next: tuple[int, int] | None = None  # None: the first batch, query 0
        self.spares_begun = 0
        self._redrawn: list[BegunEpisode] = []
        # A resume's: the spares begun before its checkpoint, those still over (each batch up
        # to the checkpoint trained queries_per_step; the last one every spare) and still owed.
        self._spares_begun_before = self._spares_over = self._spares_owed_before = 0
        # Continuous admission: the running episodes by slot, for abandoning a doomed one;
        # how many were abandoned (each renewed by a spare); what begins that spare.
        self._live: dict[EpisodeSlot, tuple[BegunEpisode, asyncio.Task]] = {}
        self.abandoned = 0
        self._renew: Callable[[int], None] = lambda batch: None
        self._spares_lock = asyncio.Lock()

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
        redrawn = {b.name for b in self._redrawn}
        # The episodes (and top-ups) under way. A finished one leaves at once: a run starts
        # millions, and a finished task keeps its context (and what that reaches) alive. One
        # that ended with an error escaping `one` is kept, to be raised at the end.
        running: set[asyncio.Task] = set()
        failed: list[asyncio.Task] = []

        def finished(task: asyncio.Task) -> None:
            running.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failed.append(task)

        def spawn(coro: Any, name: str) -> None:
            task = asyncio.create_task(coro, name=name)
            running.add(task)
            task.add_done_callback(finished)

        async def one(begun: BegunEpisode) -> None:
            failure, stopped, abandoned = "", False, False
            batch, name = begun.started, begun.name
            slot, ctx = self.schedule.slot(batch), None
            task = asyncio.current_task()
            assert task is not None
            self._live[slot] = (begun, task)
            try:
                ctx = self.contexts.make(name, batch, random.Random(
                    f"{seed}-{batch}-{'' if begun.kind == 'q' else begun.kind}{begun.index}"),
                    self.store, self.dataset.item(begun.number) if self.dataset else None,
                    gate=self.schedule.gate_of(slot, lambda slot: self.emit(
                        ev.EpisodeAdmitted(name, slot.started, slot.admitted or 0, slot.drained))))
                why = await run_episode(self.workflow, ctx, p.episode_timeout_s)
                if why:
                    self.failed += 1
                    failure = f"{why}\n{ctx.failure}" if ctx.failure != why else why
            except RunFailed as exc:  # not this episode's failure: the run cannot go on
                stopped = True  # and the episode never ends: the batch is not trained on what it lacks
                self._stop_with(exc)
            except asyncio.CancelledError:  # the run is stopping: nor does an episode cut short
                if not slot.doomed:
                    stopped = True
                    raise
                abandoned = True  # no batch could train it (`_abandon_doomed`): it ends here, in no batch
            finally:
                limit.release()
                del self._live[slot]
                abandoned = abandoned or (slot.doomed and not stopped)  # ended as the cancel came
                if not stopped and not abandoned:
                    if self.schedule.continuous:  # the batch that trains it: named now
                        batch = self.schedule.assign(slot)
                        self.emit(ev.EpisodeAssigned(name, begun.started, batch))
                        self.store.assign(ctx.opened if ctx is not None else (), batch)
                        self._abandon_doomed()
                    self._ended(begun, batch)
                    self.schedule.episode_ended(batch, failure)
            if abandoned and ctx is not None:
                await ctx.close(decisions.ABANDONED)  # its branches stop; what they opened is dropped
                self.store.abandon(ctx.opened, decisions.ABANDONED)
            if failure:
                self._check_failures(batch)

        async def begin(begun: BegunEpisode) -> None:
            await limit.acquire()
            self._begun[begun.name] = begun  # with `_next` and the spares' count, in the same loop turn
            if begun.name in redrawn:
                pass
            elif begun.kind == "q":
                last = begun.index + 1 == p.queries_per_step
                self._next = (begun.started + 1, 0) if last else (begun.started, begun.index + 1)
            elif begun.kind == "p":
                self.spares_begun += 1
            spawn(one(begun), f"episode-{begun.name}")

        def renew(batch: int) -> None:
            """A spare in place of an abandoned episode, begun as soon as the bound lets it."""
            spawn(self._start_spares(batch, start), f"spare-after-abandoned-{self.abandoned}")

        self._renew = renew

        async def start(batch: int, i: int, extra: bool = False, spare: bool = False) -> None:
            kind = "x" if extra else "p" if spare else "q"
            number = (self.extra_episode_number(batch, i) if extra else self.spare_episode_number(i) if spare
                      else self.episode_number(batch, i))
            await begin(BegunEpisode(f"s{batch}{kind}{i}", batch, kind, i, number))
            if i % EPISODES_PER_TURN == EPISODES_PER_TURN - 1:
                await asyncio.sleep(0)  # the rest start in later loop turns

        try:
            for n, begun in enumerate(self._redrawn):  # a resume's episodes in flight at its checkpoint, first
                await begin(begun)
                if n % EPISODES_PER_TURN == EPISODES_PER_TURN - 1:
                    await asyncio.sleep(0)
            first, query = self._next or (self.schedule.first_batch, 0)
            for batch in range(first, self.schedule.steps + 1):
                if batch >= self.schedule.first_batch:  # not a batch a resume's checkpoint trained
                    await self.schedule.wait_to_start(batch)
                    self.emit(self.batch_started(batch))
                if self.dynamic:
                    self.schedule.hold(batch)
                    spawn(self._top_up(batch, start), f"top-up-s{batch}")
                for i in range(query if batch == first else 0, p.queries_per_step):
                    await start(batch, i)
                if batch == first:  # partial rollout's spares: over-provisioned once for the run
                    await self._start_spares(batch, start)
            await self._start_spares(min(first, self.schedule.steps), start)  # owed past the end: a resume's
            while running and not failed:  # top-ups add episodes meanwhile
                await asyncio.gather(*running)
            for task in failed:
                task.result()  # raises what ended it
        finally:
            left = list(running)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    async def _top_up(self, batch: int, start: Any) -> None:
        """Draws extra episodes of `batch` until every dynamic-sampling agent has as many
        trainable groups as its regular episodes opened (see the module doc)."""
        p = self.cfg.pipeline
        await self.schedule.settled(batch)
        targets = {a: self.store.groups_opened(a, batch) for a in self.dynamic}
        for agent, n in targets.items():
            self.store.set_target(agent, batch, n)
        self.emit(ev.GroupTargets(batch, targets))
        per_episode = {a: n / p.queries_per_step for a, n in targets.items()}
        drawn = 0
        while True:
            missing = {a: n - self.store.groups_kept(a, batch) for a, n in targets.items()}
            if all(n <= 0 for n in missing.values()):
                break
            more = decisions.extra_episodes(missing, per_episode, drawn, p.extra_episodes())
            if more == 0:
                agent = max(missing, key=lambda a: missing[a])
                self._stop_with(RunFailed(
                    f"dynamic sampling: agent {agent!r} has {targets[agent] - missing[agent]} of the "
                    f"{targets[agent]} groups step {batch} trains after {drawn} extra episodes "
                    f"(pipeline.max_extra_episodes = {p.extra_episodes()}): the rest had all rewards equal. Raise "
                    f"pipeline.max_extra_episodes, make the rewards vary within a group, or set "
                    f"agents.{agent}.dynamic_sampling = false"))
                return  # the batch stays held: nothing trains on what it lacks
            self.schedule.add_episodes(batch, more)
            self.emit(ev.EpisodesDrawn(batch, more, {a: n for a, n in missing.items() if n > 0}))
            for j in range(drawn, drawn + more):
                await start(batch, j, extra=True)
            drawn += more
            await self.schedule.settled(batch)
        self.schedule.release(batch)

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

    def _spares_owed(self) -> int:
        """The spares still to begin: those the schedule counts beyond the ones over at a
        resume's checkpoint (`_spares_over`), those that checkpoint's run still owed, less
        those begun since."""
        return (self.schedule.spares + self.abandoned - self._spares_over + self._spares_owed_before
                - (self.spares_begun - self._spares_begun_before))

    async def _start_spares(self, batch: int, start: Any) -> None:
        """Begins the spares owed, numbered after every spare begun before (one at a time:
        an abandoned episode's renewal may ask while the first batch's are beginning)."""
        async with self._spares_lock:
            while self._spares_owed() > 0:
                await start(batch, self.spares_begun, spare=True)

    def _abandon_doomed(self) -> None:
        """The running episodes no batch can train any more (`BatchSchedule.doomed`) are
        abandoned: logged, cancelled (their requests aborted in the engines, their groups
        dropped as `decisions.ABANDONED` when the cancel reaches them), out of what a
        checkpoint records, and each renewed by a fresh spare."""
        for slot in self.schedule.doomed():
            begun, task = self._live[slot]
            self.emit(ev.EpisodeAbandoned(begun.name, begun.started, slot.admitted or 0))
            self._begun.pop(begun.name, None)
            self.abandoned += 1
            task.cancel()
            self._renew(begun.started)

    def _ended(self, begun: BegunEpisode, batch: int) -> None:
        """`begun` ended and batch `batch` trains it; the episodes of batches trained since
        leave the record (one look per ended episode)."""
        begun.assigned = batch
        self._ended_in.setdefault(batch, []).append(begun.name)
        batches = self.schedule.batches
        while self._pruned + 1 in batches and batches[self._pruned + 1].trained_done.is_set():
            self._pruned += 1
            for name in self._ended_in.pop(self._pruned, ()):
                self._begun.pop(name, None)

    def in_flight(self, step: int) -> dict[str, Any]:
        """What a checkpoint of `step` records of the episodes: those begun that no batch up
        to `step` trains (running, or ended and taken by a later batch), in the order they
        began; the next regular episode to begin, as [batch, query]; the spares begun, and
        how many episodes beyond queries_per_step a batch are still to train (the spares
        over). A resume begins exactly those again (`redraw`), and then the rest."""
        first, query = self._next or (self.schedule.first_batch, 0)
        over = self.schedule.spares if step < self.schedule.steps else 0  # the last batch trained them
        return {"next": [first, query], "spares_begun": self.spares_begun, "spares_over": over,
                "spares_owed": self._spares_owed() if over else 0,
                "in_flight": [asdict(b) for b in self._begun.values() if b.assigned is None or b.assigned > step]}

    def redraw(self, record: dict[str, Any]) -> None:
        """A resume from a checkpoint whose `in_flight` record is `record`: its episodes are
        begun again, with the names, seeds and rows they had, before the episodes after them."""
        self._redrawn = [BegunEpisode(b["name"], b["started"], b["kind"], b["index"], b["number"])
                         for b in record["in_flight"]]
        first, query = record["next"]
        self._next = (first, query)
        self.spares_begun = self._spares_begun_before = record["spares_begun"]
        self._spares_over, self._spares_owed_before = record["spares_over"], record["spares_owed"]

    def continue_data(self, batch: int, episode: int) -> None:
        """Batch `batch` starts at episode number `episode` (a resume's saved position)."""
        self.first_batch, self.first_episode = batch, episode

    def episode_number(self, batch: int, i: int) -> int:
        """Which episode of the run (and so which row of the data) query i of `batch` is."""
        return self.first_episode + (batch - self.first_batch) * self.cfg.pipeline.queries_per_step + i

    def extra_episode_number(self, batch: int, j: int) -> int:
        """Which episode of the run (and row of the data) extra episode j of `batch` is:
        after every regular one, each batch its own `pipeline.extra_episodes()` of them."""
        return (self.episode_number(self.schedule.steps + 1, 0)
                + (batch - 1) * self.cfg.pipeline.extra_episodes() + j)

    def spare_episode_number(self, j: int) -> int:
        """Which episode of the run (and row of the data) spare episode j (partial
        rollout's over-provisioning) is: after every regular and extra one."""
        return self.extra_episode_number(self.schedule.steps + 1, 0) + j

    def batch_started(self, batch: int) -> ev.BatchStarted:
        q = self.cfg.pipeline.queries_per_step
        first = self.episode_number(batch, 0)
        if self.dataset is None:
            return ev.BatchStarted(batch, first)
        positions = [self.dataset.position(first + i) for i in range(q)]
        return ev.BatchStarted(batch, first, positions[0].epoch, [pos.index for pos in positions])

