"""The training driver: places the agents on the workers and runs the components' loops.

`TrainingRun.run()` sets the agents up on the workers (rollout instances placed and
loaded, training states initialised), then runs these loops under
one supervisor (the first to fail stops the others), and writes the final checkpoint:

- episodes (episodes/producer.py, `EpisodeProducer.run`): consumes the workflow; produces samples
  in the store, batch by batch; waits for the schedule's start rule and, every turn, its
  staleness gate; unblocked by weight syncs.
- train-AGENT, one per agent (train/pipeline.py, `AgentPipeline.run`): consumes the agent's
  ready groups; produces micro-batches on a trainer, one optimizer step and one weight
  sync per global batch, metrics rows; waits for ready groups or the batch's end, and
  for a trainer; unblocked by the store (a group became trainable) and by the producer
  (a batch's last episode ended).
- balance (rollout/balance_loop.py, `Rebalancer.run`, with `router.across_agents`): consumes the
  rollout client's demand counters; produces instance moves between agents; waits for
  its observation interval; ends once every batch is trained.
- placement, with `router.measured_placement` (the default) or without
  `router.across_agents`: waits for the first batch's rollout to end; where the
  instances' shares of its work were uneven and the most-asked agent's instances busy,
  moves instances so that each agent's share follows it (`Rebalancer.place_by_measure`),
  or without `router.measured_placement` says so in the log and what to set instead
  (`Rebalancer.placement_hint`).
- environments, with `cluster.env_workers` (environments/client.py, `EnvClient.run`):
  consumes environment workers that register after set-up (a restarted one); produces
  them set up (the workflow's module imported in their pools) and routed to.
- rejoin (rollout/rejoin.py, `Rejoin.run`): consumes rollout workers that register after set-up
  (a restarted one, say), or during it in place of one that died there; produces them serving an agent at its current version; waits
  for a worker to join; ends once every batch is trained. A trainer that joins is handed
  to the allocator.
- eval, when `eval.every` > 0 (episodes/evaluation.py, `Evaluator.run`): consumes held-out rows;
  produces eval metrics rows; waits for the versions it evaluates to be synced; never
  trains.
- openai-endpoint, with `openai.enabled` (serving/openai_api.py): consumes HTTP calls whose key
  names a live episode; produces turns of that episode (through its context); watched
  like the receive loop: its end stops the run.

Every component is made once, before any worker starts, by components.py (`resolve`, then
`build`; its docstring says in what order and how to add one); this module only places
and loads the agents once the workers registered, then starts and supervises the loops.
What they share is handed to each: the experience store (state/store.py), the batch
schedule (state/schedule.py: per-batch progress, gate, wake-ups), each agent's synced
version (state/versions.py), the rollout instances and their admission
(state/instances.py, rollout/admission.py), the weight sync (weights/sync.py), the
rollout client (rollout/router.py), the trainer allocator (train/allocator.py), the
metrics log (records/metrics.py) and the event log's `emit`. None of them refers back to this
module.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, cast

from flexmarl.runtime import bases, protocol
from flexmarl.runtime import events as ev
from flexmarl.runtime.aio import supervise
from flexmarl.runtime.atomic import write_text_atomically
from flexmarl.runtime.config import ExperimentConfig, dump_toml, trained_agents

from ..control.interfaces import Emit
from ..control.registry import WorkerInfo
from ..control.server import ControllerServer
from ..records.progress import SetupProgress
from ..state import decisions
from ..state.failures import RunFailed
from ..train.checkpoints import ResumePoint, at_checkpoint, resume_placement
from .components import Components, Given, build, resolve

log = logging.getLogger("flexmarl.training")


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


Demand = Callable[[dict[str, Any], str], float]


class TrainingRun:
    """One training run: its components (components.py) built at once, before any worker
    starts, so a bad name in the config fails before anything runs. `demand` weighs each
    agent for the initial placement of rollout instances (the rule `router.placement` names,
    decisions.PLACEMENT_DEMAND, or a caller's: decisions.equal_demand gives every agent alike)."""

    def __init__(self, cfg: ExperimentConfig, server: ControllerServer, run_dir: str | Path, *,
                 emit: Emit, flush_events: Callable[[], Awaitable[None]],
                 worker_ids: Callable[[str], list[str]], resume: ResumePoint | None = None,
                 restarting: Callable[[str], bool] = lambda role: False,
                 demand: Demand | None = None) -> None:
        self.cfg = cfg
        self.server = server
        self.run_dir = Path(run_dir)
        self.emit = emit
        self.worker_ids = worker_ids  # the registered workers of a role, at set-up
        self.resume = resume
        self.demand = demand or decisions.PLACEMENT_DEMAND[cfg.router.placement]
        self.parts: Components = build(cfg, resolve(cfg, self.run_dir),
                                       Given(server, self.run_dir, emit, flush_events, resume, restarting))
        self.started = self.wall_s = 0.0
        self.busy: dict[str, float] = {}  # worker -> busy fraction of the training wall time, once run
        self._loads_at_start: dict[str, float] = {}
        server.on_died.append(self._on_worker_died)
        server.on_joined.append(self.parts.rejoin.joined)
        server.on_joined.append(self.parts.environments.joined)

    @property
    def reassignments(self) -> list:
        return self.parts.rebalancer.reassignments

    # ------------------------------------------------------------ the loops

    async def run(self) -> RunSummary:
        """Sets up, runs the loops listed in the module docstring until the last batch is
        trained (the first loop to fail stops the others), checkpoints, summarises."""
        parts, p = self.parts, self.cfg.pipeline
        if self.resume is None:
            self.emit(ev.RunStarted(dump_toml(self.cfg), list(self.cfg.agents), p.mode, p.max_staleness,
                                    self.cfg.run.seed))
        else:
            self.emit(ev.RunResumed(self.resume.step, str(self.resume.path), dump_toml(self.cfg)))
        try:
            await self.setup()
            watch: list[asyncio.Task] = []
            if parts.endpoint is not None:
                write_text_atomically(self.run_dir / "openai.url", await parts.endpoint.start() + "\n")
                assert parts.endpoint.task is not None  # start() made it
                watch.append(parts.endpoint.task)
            self._loads_at_start = await self._worker_loads()
            self.started = time.monotonic()
            parts.metrics.training_started()
            await supervise(self._loops(), watch=watch)
        finally:  # in order: nothing of the loops or the endpoint is left under way, then what they used closes
            if parts.endpoint is not None:
                await parts.endpoint.stop()
            await parts.client.close()
            await parts.environments.close()
            parts.tools.shutdown(wait=False, cancel_futures=True)
            await parts.metrics.aclose()
            await parts.allocator.close()
        self.wall_s = time.monotonic() - self.started
        self.emit(ev.RunFinished(self.cfg.run.steps, self.wall_s))
        self.busy = await self._busy_fractions()
        steps = self.cfg.run.steps - (parts.schedule.first_batch - 1)  # in this process (after a resume: the rest)
        return RunSummary(steps, self.wall_s, self.samples_trained, self.tokens_trained,
                          parts.episodes.failed, parts.metrics.reward_history(), str(self.run_dir))

    def _loops(self) -> list[asyncio.Task]:
        parts = self.parts
        loops = [asyncio.create_task(parts.episodes.run(), name="episodes"),
                 asyncio.create_task(parts.rejoin.run(), name="rejoin"),
                 *(asyncio.create_task(pl.run(), name=f"train-{a}") for a, pl in parts.pipelines.items())]
        if self.cfg.router.across_agents:
            loops.append(asyncio.create_task(parts.rebalancer.run(), name="balance"))
        if self.cfg.router.measured_placement or not self.cfg.router.across_agents:
            loops.append(asyncio.create_task(self._measure_placement(), name="placement"))
        if self.cfg.cluster.env_workers:
            loops.append(asyncio.create_task(parts.environments.run(), name="environments"))
        if self.cfg.eval.every > 0:
            loops.append(asyncio.create_task(parts.evaluator.run(), name="eval"))
        return loops

    async def _measure_placement(self) -> None:
        """Once the first batch's rollout ended, where the instances' shares of its work were
        uneven: with `router.measured_placement`, places them again by that work
        (`Rebalancer.place_by_measure`); without, says so in the log and how to place them
        instead (`Rebalancer.placement_hint`)."""
        first = self.parts.schedule.first_batch
        if first > self.cfg.run.steps:
            return
        await self.parts.schedule.batches[first].rollout_done.wait()
        if self.cfg.router.measured_placement:
            if first < self.cfg.run.steps:  # a batch is left to gain from it
                busy_s = await self._worker_loads()
                since = {w: b - self._loads_at_start.get(w, 0.0) for w, b in busy_s.items()}
                await self.parts.rebalancer.place_by_measure(first, since, time.monotonic() - self.started)
            return
        units = self.parts.resolved.units
        rules = {name: decisions.unit_weights(units, functools.partial(rule, self.cfg.agents))
                 for name, rule in decisions.PLACEMENT_DEMAND.items()}
        hint = self.parts.rebalancer.placement_hint(first, rules)
        if hint:
            log.warning("%s", hint)

    @property
    def samples_trained(self) -> int:
        return sum(pl.samples_trained for pl in self.parts.pipelines.values())

    @property
    def tokens_trained(self) -> int:
        return sum(pl.tokens_trained for pl in self.parts.pipelines.values())

    # ------------------------------------------------------------ set-up

    async def setup(self) -> None:
        """Once the workers registered: the trainers join the allocator's pool (a resumed
        run's agents restored from the checkpoint), the rollout instances are placed, their
        engines started, the agents' training states initialised and the environment
        workers' pools started (a worker that cannot import the workflow's module stops the
        run here, in one line).

        A rollout worker that dies while its engine starts does not stop the run: set-up
        goes on without it and its next process (restarted, or registered again already
        while set-up ran) is admitted like any worker that rejoins (rejoin.py). One that
        refuses its engine (alive, but it cannot load the model) stops the run in one line
        naming it. A trainer registered again while set-up runs joins the pool at once."""
        parts, agents = self.parts, trained_agents(self.cfg)
        placed = {w.worker_id: w for w in self.server.registry.alive()}  # the registrations set up here
        for trainer in self.worker_ids("trainer"):
            parts.allocator.trainer_joined(trainer)
        if self.resume is not None:
            for agent in agents:
                parts.allocator.recover(agent, self.resume.training_state(agent), self.resume.step,
                                        self.resume.training_state_checksum(agent))
        parts.rejoin.open(placed, "trainer")
        placement = self._placement()
        log.info("rollout placement: %s", placement)
        parts.instances.place(placement)
        engines = [(u, w) for u, ws in placement.items() for w in ws]
        display = SetupProgress(self.cfg.run.progress)
        with display.stage(f"starting {len(engines)} rollout engines and {len(agents)} training states") as stage:
            stage.update(0, len(engines) + 2)

            async def counted(work: Awaitable[Any]) -> Any:
                result = await work
                stage.update((stage.done or 0) + 1)
                return result

            admitted = await asyncio.gather(*(counted(self._place(a, w)) for a, w in engines),
                                            counted(parts.environments.start(self.worker_ids("env"))),
                                            counted(self._init_agents()))
        failed = [(unit, worker) for (unit, worker), ok in zip(engines, admitted[:-2]) if not ok]
        refused = [f"{worker} ({unit})" for unit, worker in failed if self._same_process(worker, placed)]
        if refused:
            raise RunFailed(f"the run stopped at set-up: rollout worker {', '.join(refused)} could not start its "
                            f"engine; its log in {self.run_dir / 'logs'} says why. Fix that and run again")
        for unit, worker in failed:
            log.warning("%s died while starting %s's engine at set-up; the run goes on without it, and its next "
                        "process serves an agent once it registers", worker, unit)
        parts.ready.set()
        parts.rejoin.open(placed, "rollout")  # a replacement registered meanwhile is admitted now

    def _same_process(self, worker: str, placed: dict[str, WorkerInfo]) -> bool:
        """Whether `worker` is still, alive, the registration set-up took (`placed`)."""
        info = self.server.registry.workers.get(worker)
        return info is not None and info is placed.get(worker) and info.alive

    def _placement(self) -> dict[str, list[str]]:
        """Engine units over the rollout workers (a base's instances serve all its agents;
        each agent is routed over its unit's instances): as at the checkpoint a run resumes
        from, where the workers are the same, else by the units' expected demand."""
        units, workers = self.parts.resolved.units, self.worker_ids("rollout")
        saved = resume_placement(self.resume, units, workers)
        if saved is not None:
            return saved
        weight = decisions.unit_weights(units, lambda agent: self.demand(self.cfg.agents, agent))
        return decisions.place_agents(list(units), workers, weight)

    async def _init_agents(self) -> None:
        for agent in trained_agents(self.cfg):  # in order: with limited capacity, later ones park earlier ones
            await self.parts.allocator.acquire(agent)
            self.parts.allocator.release(agent)

    async def _place(self, unit: str, worker: str) -> bool:
        message = at_checkpoint(self.parts.load_message(unit), self.resume, self.parts.resolved.units[unit])
        return await self.parts.admission.admit(worker, unit, engine=message, why="joins: initial placement")

    def _on_worker_died(self, info: Any) -> None:
        if self.server.closing:  # workers leaving after SHUTDOWN
            return
        self.parts.instances.died(info.worker_id)
        self.parts.environments.died(info)
        if info.worker_id in self.parts.allocator.trainers:
            lost = self.parts.allocator.trainer_died(info.worker_id)
            if lost:
                log.warning("trainer %s died holding %s; each is restored from its last saved state and "
                            "trained again from there", info.worker_id, ", ".join(lost))
            for agent in lost:  # a pipeline waiting for samples restores its agent at once
                self.parts.schedule.work_arrived(agent)

    # ------------------------------------------------------------ measurements

    def stage_times(self) -> dict[str, float]:
        return self.parts.schedule.stage_times()

    async def _worker_loads(self) -> dict[str, float]:
        """Each live worker's busy seconds, asked for now (a heartbeat's may be a second
        old, and one from before set-up ended would count set-up as work)."""
        workers = [w.worker_id for w in self.server.registry.alive()]
        replies = await asyncio.gather(*(self.server.call(w, protocol.Echo(self.server.next_request_id()))
                                         for w in workers), return_exceptions=True)
        return {w: cast(protocol.EchoReply, r[0]).load.get("busy_s", 0.0)  # an Echo's reply is an EchoReply
                for w, r in zip(workers, replies) if not isinstance(r, BaseException)}

    async def _busy_fractions(self) -> dict[str, float]:
        end = await self._worker_loads()
        return {w: round((end[w] - self._loads_at_start.get(w, 0.0)) / self.wall_s, 3)
                for w in end if self.wall_s > 0 and w in self._loads_at_start}


def whole_model_message(cfg: ExperimentConfig, agent: str, request_id: int, path: str,
                        version: int = 0) -> protocol.LoadModel:
    """What starts an engine on a whole-model agent's weights in `path`, as `version`."""
    return bases.engine_units(cfg)[agent].load_message(request_id, path, cfg.run.seed, version)
