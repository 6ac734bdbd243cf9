"""The training driver: set up agents on workers, then iterate rollout -> train -> sync.

Components it wires together (none of them refers back to it):
- `ExperienceStore` (store.py): samples, groups, exactly-once consumption;
- `RolloutClient` (router.py): batched generation requests, routing, re-issue;
- the workflow (workflow.py, workflows.py): user episodes that call agents and reward them;
- `MetricsLog` (metrics.py): metrics.jsonl, progress line, reward plot.

The schedule: global batch t (`queries_per_step` episodes) trains every agent from
version t - 1 to t with one optimizer step and one weight sync per agent. In sync mode
batch t's episodes start when every agent's rollout weights are at t - 1 and micro-batches
are formed once the batch is complete. In async mode episodes start at once, each turn
waits at the staleness gate, and each agent's micro-batches go to its trainer as soon as
they are ready, so agents train while rollout continues and move independently. The
rules themselves are in decisions.py. Model resolution and placement live here too.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.config import dump_toml
from flexmarl.runtime.param_types import ParamHandle

from . import decisions, rebalance
from .allocator import TrainerAllocator
from .metrics import MetricsLog
from .router import RolloutClient
from .server import WorkerDied
from .store import ExperienceStore, Sample
from .workflow import AgentDefaults, EpisodeContext, run_episode
from .workflows import get_workflow

if TYPE_CHECKING:
    from .experiment import Experiment

log = logging.getLogger("flexmarl.training")

MODEL_CACHE = Path(".cache/models")


def resolve_model(name: str, cache_root: Path = MODEL_CACHE) -> str:
    """`tiny:AGENT` builds (once, cached) a built-in tiny model; anything else is a path
    to a Hugging Face model directory."""
    if name.startswith("tiny:"):
        from flexmarl.workers import models

        from . import tasks

        key = name.split(":", 1)[1]
        if key not in tasks.AGENTS:
            raise KeyError(f"unknown built-in model {name!r} (built in: "
                           f"{', '.join('tiny:' + a for a in tasks.AGENTS)})")
        examples = lambda: tasks.warmup_examples(key, random.Random(f"warmup-{key}"), tasks.WARMUP_EXAMPLES)  # noqa: E731
        return str(models.ensure_model(tasks.AGENTS[key], cache_root, examples, tasks.WARMUP_VERSION,
                                       tasks.WARMUP_SCHEDULE))
    path = Path(name)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {name!r} is neither a built-in (tiny:NAME) nor a directory "
                                f"with a config.json")
    return str(path)


def place_agents(agents: list[str], instances: list[str], weight: dict[str, float]) -> dict[str, list[str]]:
    """Initial placement: every agent gets one instance, spare instances go to the agents
    with the most expected work per instance."""
    if len(instances) < len(agents):
        raise ValueError(f"{len(agents)} agents need at least {len(agents)} rollout workers, "
                         f"have {len(instances)}")
    plan = {a: [w] for a, w in zip(agents, instances)}
    for w in instances[len(agents):]:
        busiest = max(agents, key=lambda a: (weight[a] / len(plan[a]), a))
        plan[busiest].append(w)
    return plan


@dataclass
class StepTimes:
    rollout_s: float = 0.0
    train_s: float = 0.0
    sync_s: float = 0.0


@dataclass
class RunSummary:
    steps: int
    wall_s: float
    samples: int
    tokens: int
    episodes_failed: int
    rewards: dict[str, list[float]]
    run_dir: str = ""

    def reward_change(self, agent: str, window: int = 5) -> tuple[float, float]:
        r = self.rewards[agent]
        w = max(1, min(window, len(r) // 2))
        return sum(r[:w]) / w, sum(r[-w:]) / w

    def report(self) -> str:
        lines = [f"{self.steps} steps in {self.wall_s:.1f}s (after set-up): {self.samples / self.wall_s:.1f} samples/s, "
                 f"{self.tokens / self.wall_s:.0f} tokens/s, {self.episodes_failed} failed episodes"]
        for agent in self.rewards:
            start, end = self.reward_change(agent)
            lines.append(f"  {agent:>8}: reward {start:.3f} -> {end:.3f} (mean of first/last steps)")
        lines.append(f"run directory: {self.run_dir}")
        return "\n".join(lines)


class TrainingRun:
    def __init__(self, exp: "Experiment") -> None:
        self.exp = exp
        self.cfg = exp.config
        self.server = exp.server
        self.agents = list(self.cfg.agents)
        if not self.agents:
            raise ValueError("the config defines no agents ([agents.NAME] tables)")
        self.workflow = get_workflow(self.cfg.run.workflow)
        self.emit = exp.emit
        self.store = ExperienceStore(self.agents, emit=self.emit)
        self.client = RolloutClient(self.server, emit=self.emit, within_agent=self.cfg.router.within_agent)
        self.allocator: TrainerAllocator | None = None
        self.version = {a: 0 for a in self.agents}
        self.model_path: dict[str, str] = {}
        self.metrics = MetricsLog(exp.run_dir, self.agents, progress=self.cfg.run.progress)
        self.failed_episodes = 0
        self.samples_trained = 0
        self.tokens_trained = 0
        self.overlap = self.cfg.pipeline.mode == "async"
        self.synced = {a: 0 for a in self.agents}  # version every rollout instance of the agent holds
        steps = self.cfg.run.steps
        self.batch_done = {t: asyncio.Event() for t in range(1, steps + 1)}
        self._episodes_left = {t: self.cfg.pipeline.queries_per_step for t in range(1, steps + 1)}
        self._steps_done = collections.Counter()
        self.stage_start: dict[int, float] = {}
        self.stage_end: dict[int, float] = {}  # the batch's last episode finished
        self.batch_trained: dict[int, float] = {}  # every agent stepped and synced the batch
        self._wake = {a: asyncio.Event() for a in self.agents}
        self._version_changed = asyncio.Event()
        self.store.on_ready.append(self._on_group_ready)
        self.ready = asyncio.Event()  # set once agents are placed and loaded
        # Held while an agent's weights are published and loaded, so an instance joining
        # the agent (reassignment) never loads a handle the trainer is about to release.
        self.sync_lock = {a: asyncio.Lock() for a in self.agents}
        self.published: dict[str, ParamHandle] = {}  # agent -> handle of its synced version
        self.server.on_died.append(self._on_worker_died)
        self._loads_at_start: dict[str, float] = {}
        self.started = self.wall_s = 0.0
        self.busy: dict[str, float] = {}
        self.reassignments: list[rebalance.Reassignment] = []  # rollout instances moved between agents

    # ------------------------------------------------------------ setup

    async def setup(self) -> None:
        for agent in self.agents:
            spec = self.cfg.agents[agent].model
            self.model_path[agent] = await asyncio.to_thread(resolve_model, spec)
        weight = {a: self._expected_tokens(a) for a in self.agents}
        self.client.assignment = place_agents(self.agents, self.exp.worker_ids("rollout"), weight)
        for agent in self.agents:
            self.emit(ev.AllocationChanged("rollout", agent, list(self.client.assignment[agent]), "initial placement"))
        log.info("rollout placement: %s", self.client.assignment)
        self.allocator = TrainerAllocator(self.server, self.exp.worker_ids("trainer"), self.cfg.cluster.trainer_capacity,
                                          self.cfg.agents, self.model_path, self.cfg.run.seed,
                                          self._ready_work, self.emit)
        await asyncio.gather(*(self._load_model(a, w) for a, ws in self.client.assignment.items() for w in ws),
                             self._init_agents())
        self.ready.set()

    async def _init_agents(self) -> None:
        for agent in self.agents:  # in order: with limited capacity, later ones park earlier ones
            await self.allocator.acquire(agent)
            self.allocator.release(agent)

    def _ready_work(self, agent: str) -> int:
        return sum(len(q) for q in self.store.ready[agent].values())

    def _on_worker_died(self, info) -> None:
        if self.server.closing:  # workers leaving after SHUTDOWN
            return
        for agent, workers in self.client.assignment.items():
            if info.worker_id in workers:
                workers.remove(info.worker_id)
                self.emit(ev.AllocationChanged("rollout", agent, list(workers), f"{info.worker_id} died"))
                if not workers:
                    log.error("agent %s has no rollout instance left", agent)
        if self.allocator is not None and info.worker_id in self.allocator.trainers:
            lost = self.allocator.trainer_died(info.worker_id)
            if lost:
                log.error("trainer %s died holding %s; their training states since the last checkpoint "
                          "are lost and the run stops", info.worker_id, lost)

    def _expected_tokens(self, agent: str) -> float:
        # Rough demand for the initial placement: requests multiply down a chain, so use
        # configured group size x output length; the router corrects with measurements.
        a = self.cfg.agents[agent]
        return a.group_size * a.max_tokens * (1 + self.agents.index(agent))

    async def _load_model(self, agent: str, worker: str) -> None:
        msg = protocol.LoadModel(self.server.next_request_id(), agent, self.model_path[agent],
                                 self.version[agent], seed=self.cfg.run.seed)
        reply, _ = await self.server.call(worker, msg)
        log.info("%s serves %s (%.1fs to start the engine)", worker, agent, reply.seconds)

    # ------------------------------------------------------------ the loop

    async def run(self) -> RunSummary:
        p = self.cfg.pipeline
        self.emit(ev.RunStarted(dump_toml(self.cfg), self.agents, p.mode, p.max_staleness, self.cfg.run.seed))
        try:
            await self.setup()
            self._loads_at_start = await self._worker_loads()
            self.started = time.monotonic()
            loops = [asyncio.create_task(self.produce_episodes(), name="episodes"),
                     *(asyncio.create_task(self.agent_loop(a), name=f"train-{a}") for a in self.agents)]
            if self.cfg.router.across_agents:  # level 1 balancing; ends once every batch is trained
                loops.append(asyncio.create_task(rebalance.balance_loop(self), name="balance"))
            await _all_or_first_failure(loops)
            await self.checkpoint("final")
        finally:
            self.metrics.close()
        self.wall_s = time.monotonic() - self.started
        self.emit(ev.RunFinished(self.cfg.run.steps, self.wall_s))
        self.busy = await self._busy_fractions()
        return RunSummary(self.cfg.run.steps, self.wall_s, self.samples_trained,
                          self.tokens_trained, self.failed_episodes, self.metrics.reward_history(),
                          str(self.exp.run_dir))

    async def produce_episodes(self) -> None:
        """Starts every episode of every global batch, in order, bounded by
        max_concurrent_episodes. Sync mode waits for all agents' weights of the previous
        batch first; async mode starts at once and each turn waits at the gate."""
        p = self.cfg.pipeline
        limit = asyncio.Semaphore(p.max_concurrent_episodes)
        defaults = {a: AgentDefaults(c.max_tokens, c.temperature, c.group_size) for a, c in self.cfg.agents.items()}
        running: list[asyncio.Task] = []

        async def one(tag: int, i: int) -> None:
            try:
                ctx = EpisodeContext(f"s{tag}q{i}", tag, random.Random(f"{self.cfg.run.seed}-{tag}-{i}"),
                                     self.store, self.client, defaults, self.cfg.run.seed,
                                     self.cfg.run.env_latency_ms, gate=self.gate)
                if await run_episode(self.workflow, ctx, p.episode_timeout_s):
                    self.failed_episodes += 1
            finally:
                limit.release()
                self._episodes_left[tag] -= 1
                if self._episodes_left[tag] == 0:
                    self.batch_done[tag].set()
                    self.stage_end[tag] = time.monotonic()
                    self._wake_all()

        for tag in range(1, self.cfg.run.steps + 1):
            while not decisions.may_start_episode(tag, self.synced, self.overlap):
                await self._changed()
            self.stage_start.setdefault(tag, time.monotonic())
            for i in range(p.queries_per_step):
                await limit.acquire()
                running.append(asyncio.create_task(one(tag, i), name=f"episode-s{tag}q{i}"))
        await asyncio.gather(*running)

    async def gate(self, agent: str, tag: int) -> None:
        while not decisions.may_generate(tag, self.synced[agent], self.cfg.pipeline.max_staleness):
            await self._changed()

    async def agent_loop(self, agent: str) -> None:
        """Per agent: for each global batch, send micro-batches to the trainer as they form
        (async) or once the batch is complete (sync); then one optimizer step and one
        weight sync. Consumes the store's ready groups; unblocks the gate."""
        p = self.cfg.pipeline
        last_end = time.monotonic()
        for tag in range(1, self.cfg.run.steps + 1):
            version = tag  # trains version tag - 1 into tag
            calls, trained = [], []
            while True:
                complete = self.batch_done[tag].is_set()
                for mb in form_micro_batches(self.store, agent, tag, p.micro_batch, complete, self.overlap,
                                             p.max_staleness):
                    trained += mb
                    # The trainer is bound when the micro-batch is sent (see MicroBatchTrained).
                    self.emit(ev.MicroBatchFormed(agent, "", version, [s.sample_id for s in mb],
                                                  [s.min_version for s in mb]))
                    calls.append(asyncio.ensure_future(self._train_micro_batch(agent, version, mb)))
                if complete:
                    break
                if self.store.ready_samples(agent, tag):
                    self.allocator.prefetch(agent)  # work is coming: swap in while rollout runs
                await self._wake_for(agent)
            train_s = sum(await asyncio.gather(*calls))
            if not trained:
                log.warning("agent %s has no trainable samples in batch %d (all episodes failed?)", agent, tag)
            scale = 1.0 / len(trained) if trained else 0.0
            trainer = await self.allocator.acquire(agent)
            try:
                async with self.allocator.slot(trainer, (0, version)):
                    await self.server.call(trainer, protocol.OptimStep(self.server.next_request_id(), agent,
                                                                       version, scale))
                self.emit(ev.OptimizerStep(agent, trainer, version, len(trained)))
                await self.exp.flush_events()  # a crash loses nothing that led to a step
                self.version[agent] = version
                self.samples_trained += len(trained)
                t_sync = time.monotonic()
                async with self.allocator.slot(trainer, (0, version)):
                    await self.sync_agent(agent, trainer)
            finally:
                self.allocator.release(agent)
            now = time.monotonic()
            self.synced[agent] = version
            self._notify()
            times = StepTimes(rollout_s=self.stage_end[tag] - self.stage_start[tag], train_s=train_s,
                              sync_s=now - t_sync)
            self.metrics.record(tag, agent, version, trained, times, step_s=round(now - last_end, 4))
            last_end = now
            self.store.forget(trained)
            self._steps_done[tag] += 1
            if self._steps_done[tag] == len(self.agents):
                self.batch_trained[tag] = now
                self.metrics.end_step(tag, self.cfg.run.steps)

    async def _train_micro_batch(self, agent: str, version: int, mb: list[Sample]) -> float:
        p = self.cfg.pipeline
        trainer = await self.allocator.acquire(agent)
        try:
            async with self.allocator.slot(trainer, (1, version)):
                reply, _ = await self.server.call(trainer, protocol.TrainMicroBatch(
                    self.server.next_request_id(), agent, version, [_train_sample(s) for s in mb],
                    p.max_staleness, p.clip_ratio))
        finally:
            self.allocator.release(agent)
        self.emit(ev.MicroBatchTrained(agent, trainer, version, len(mb), reply.seconds))
        self.tokens_trained += reply.tokens
        return reply.seconds

    # -- wake-ups: one event per agent (ready groups, batch completion) and one for versions

    def _on_group_ready(self, group) -> None:
        self._wake[group.agent].set()

    def _wake_all(self) -> None:
        for event in self._wake.values():
            event.set()

    async def _wake_for(self, agent: str) -> None:
        await self._wake[agent].wait()
        self._wake[agent].clear()

    def _notify(self) -> None:
        self._version_changed.set()
        self._version_changed = asyncio.Event()

    async def _changed(self) -> None:
        await self._version_changed.wait()

    def stage_times(self) -> dict[str, float]:
        """Mean seconds per global batch from its first episode to its last (rollout) and
        from there to the last agent's synced weights (train + sync). Back to back in sync
        mode; overlapped (and then less meaningful) in async mode."""
        tags = [t for t in self.batch_trained if t in self.stage_start]
        if not tags:
            return {"rollout_s": 0.0, "train_sync_s": 0.0}
        return {"rollout_s": sum(self.stage_end[t] - self.stage_start[t] for t in tags) / len(tags),
                "train_sync_s": sum(self.batch_trained[t] - self.stage_end[t] for t in tags) / len(tags)}

    async def _worker_loads(self) -> dict[str, float]:
        """Each live worker's busy seconds, asked for now (a heartbeat's may be a second
        old, and one from before set-up ended would count set-up as work)."""
        workers = [w.worker_id for w in self.server.registry.alive()]
        replies = await asyncio.gather(*(self.server.call(w, protocol.Echo(self.server.next_request_id()))
                                         for w in workers), return_exceptions=True)
        return {w: r[0].load.get("busy_s", 0.0) for w, r in zip(workers, replies) if not isinstance(r, BaseException)}

    async def _busy_fractions(self) -> dict[str, float]:
        end = await self._worker_loads()
        return {w: round((end[w] - self._loads_at_start.get(w, 0.0)) / self.wall_s, 3)
                for w in end if self.wall_s > 0 and w in self._loads_at_start}

    def transport_between(self, src: str, dsts: list[str]) -> str:
        """Shared memory when every receiver is on the publisher's host, TCP otherwise."""
        workers = self.server.registry.workers
        same_host = all(workers[d].host == workers[src].host for d in dsts)
        return "shm" if same_host else "tcp"

    async def sync_agent(self, agent: str, trainer: str) -> None:
        async with self.sync_lock[agent]:
            await self._sync_agent(agent, trainer)

    async def _sync_agent(self, agent: str, trainer: str) -> None:
        instances = self.client.instances(agent)
        version = self.version[agent]
        t0 = time.monotonic()
        self.emit(ev.WeightSyncStarted(agent, version, list(instances)))
        reply, _ = await self.server.call(trainer, protocol.PublishWeights(
            self.server.next_request_id(), agent, version, self.transport_between(trainer, instances), instances))
        results = await asyncio.gather(*(self.server.call(w, protocol.LoadWeights(
            self.server.next_request_id(), agent, version, reply.handle)) for w in instances),
            return_exceptions=True)
        for worker, result in zip(instances, results):
            if isinstance(result, WorkerDied):
                log.warning("%s died during the weight sync of %s; it leaves the agent", worker, agent)
            elif isinstance(result, BaseException):
                raise result
        self.published[agent] = reply.handle
        self.emit(ev.WeightSyncFinished(agent, version, time.monotonic() - t0, reply.nbytes))

    async def checkpoint(self, name: str) -> None:
        root = Path(self.exp.run_dir) / "checkpoints"
        for agent in self.agents:
            trainer = await self.allocator.acquire(agent)
            try:
                await self.server.call(trainer, protocol.SaveCheckpoint(
                    self.server.next_request_id(), agent, str((root / name / agent).resolve())))
            finally:
                self.allocator.release(agent)
        log.info("checkpoint %s written to %s", name, root / name)


def _train_sample(s: Sample) -> protocol.TrainSample:
    return protocol.TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage, s.logprobs, s.versions)


async def _all_or_first_failure(tasks: list[asyncio.Task]) -> None:
    """Waits for every task; the first one to fail cancels the rest and re-raises."""
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            raise t.exception()


def form_micro_batches(store: ExperienceStore, agent: str, tag: int, micro_batch: int, complete: bool,
                       overlap: bool, max_staleness: int) -> list[list[Sample]]:
    """Every micro-batch the rules allow now for `agent`'s global batch `tag`.

    The staleness bound is enforced here, where samples meet the trainer (at version
    tag - 1): a group with any turn too old is dropped, never trained. The gate makes
    that impossible in normal runs; this is the guarantee, the gate the mechanism."""
    formed = []
    while decisions.cut_micro_batch(store.ready_samples(agent, tag), micro_batch, complete, overlap):
        taken = store.take(agent, tag, micro_batch)
        stale = {s.group_id for s in taken if decisions.too_stale(tag - 1, s.versions, max_staleness)}
        if stale:
            bad = [s for s in taken if s.group_id in stale]
            log.error("dropping %d samples of %s older than the staleness bound %d", len(bad), agent, max_staleness)
            store.reject(bad, f"lag above max_staleness={max_staleness}")
        mb = [s for s in taken if s.group_id not in stale]
        if mb:
            formed.append(mb)
    return formed
