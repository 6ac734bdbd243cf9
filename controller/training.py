"""The training driver: wires the controller's components and runs their loops.

`TrainingRun.run()` sets the agents up on the workers (models resolved, rollout
instances placed and loaded, training states initialised), then runs these loops under
one supervisor (the first to fail stops the others), and writes the final checkpoint:

- episodes (episodes.py, `EpisodeProducer.run`): consumes the workflow; produces samples
  in the store, batch by batch; waits for the schedule's start rule and, every turn, its
  staleness gate; unblocked by weight syncs.
- train-AGENT, one per agent (pipeline.py, `AgentPipeline.run`): consumes the agent's
  ready groups; produces micro-batches on a trainer, one optimizer step and one weight
  sync per global batch, metrics rows; waits for ready groups or the batch's end, and
  for a trainer; unblocked by the store (a group became trainable) and by the producer
  (a batch's last episode ended).
- balance (balance_loop.py, `Rebalancer.run`, with `router.across_agents`): consumes the
  rollout client's demand counters; produces instance moves between agents; waits for
  its observation interval; ends once every batch is trained.
- rejoin (rejoin.py, `Rejoin.run`): consumes rollout workers that register after set-up
  (a restarted one, say); produces them serving an agent at its current version; waits
  for a worker to join; ends once every batch is trained. A trainer that joins is handed
  to the allocator.
- eval, when `eval.every` > 0 (evaluation.py, `Evaluator.run`): consumes held-out rows;
  produces eval metrics rows; waits for the versions it evaluates to be synced; never
  trains.
- openai-endpoint, with `openai.enabled` (openai_api.py): consumes HTTP calls whose key
  names a live episode; produces turns of that episode (through its context); watched
  like the receive loop: its end stops the run.

What they share is handed to each: the experience store (store.py), the batch schedule
(schedule.py: per-batch progress, gate, wake-ups), each agent's synced version
(versions.py), the rollout instances and their admission (instances.py), the weight sync
(weight_sync.py), the rollout client (router.py), the trainer allocator (allocator.py),
the metrics log (metrics.py) and the event log's `emit`. None of them refers back to this
module.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime import bases
from flexmarl.runtime.atomic import write_text_atomically
from flexmarl.runtime.aio import supervise
from flexmarl.runtime.config import ExperimentConfig, dump_toml, to_dict
from flexmarl.runtime.model_specs import has_tokenizer

from . import decisions
from .allocator import TrainerAllocator
from .checkpoints import Checkpointer, ResumePoint, check_resume, controller_state, exactness_settings
from .data import DataError, Dataset
from .episodes import EpisodeProducer
from .evaluation import Evaluator
from .instances import Admission, RolloutInstances
from .metrics import MetricsLog
from .lora_targets import check_lora_targets
from .model_resolution import TINY_PREFIX, check_model, resolve_model
from .openai_api import OpenAIEndpoint
from .pipeline import AgentPipeline
from .progress import SetupProgress
from .balance_loop import Rebalancer
from .rejoin import Rejoin
from .router import RolloutClient
from .sample_log import SampleLog
from .schedule import BatchSchedule
from .store import ExperienceStore
from .tokens import AgentTokenizer
from .trainer_lanes import TrainerLanes
from .trackers import open_trackers
from .versions import SyncedVersions
from .weight_sync import WeightSync
from .user_code import load_workflow

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


class TrainingRun:
    def __init__(self, cfg: ExperimentConfig, server: Any, run_dir: str | Path, *,
                 emit: Callable[[ev.Event], Any], flush_events: Callable[[], Awaitable[None]],
                 worker_ids: Callable[[str], list[str]], resume: ResumePoint | None = None,
                 restarting: Callable[[str], bool] = lambda role: False) -> None:
        self.cfg = cfg
        self.resume = resume  # continue from this checkpoint instead of the models' initial weights
        self.server = server
        self.run_dir = Path(run_dir)
        self.emit = emit
        self.flush_events = flush_events
        self.worker_ids = worker_ids
        self.agents = list(cfg.agents)
        if not self.agents:
            raise ValueError("the config defines no agents ([agents.NAME] tables)")
        p = cfg.pipeline
        self.workflow = load_workflow(cfg.run.workflow)
        for agent in self.agents:  # a model name that names nothing fails now, not after the engines start
            check_model(bases.model_of(cfg, agent))
            if cfg.agents[agent].base and not bases.model_of(cfg, agent).startswith(TINY_PREFIX):
                # a base given as a directory: its modules are known before any worker starts
                check_lora_targets(agent, cfg.agents[agent].lora_target_modules, bases.model_of(cfg, agent))
        # What one rollout engine serves: a whole-model agent, or every adapter agent of a base.
        self.units = bases.engine_units(cfg)
        self.unit_of = {a: u.name for u in self.units.values() for a in u.agents}
        self.lora = {a: bases.agent_lora(cfg, a) for a in self.agents}
        self.store = ExperienceStore(self.agents, emit=emit,
                                     std_normalized={a: c.normalize_adv_std for a, c in cfg.agents.items()})
        self.versions = SyncedVersions(self.agents)
        self.schedule = BatchSchedule(self.agents, cfg.run.steps, p.queries_per_step,
                                      overlap=p.mode == "async", max_staleness=p.max_staleness,
                                      versions=self.versions)
        self.store.on_ready.append(lambda group: self.schedule.work_arrived(group.agent))
        self.instances = RolloutInstances(self.units, emit)
        # Requests wait for an instance while one is on its way back: a rollout worker being
        # restarted by the launcher (`restarting`), or registered again and being admitted.
        self.client = RolloutClient(server, self.instances, emit=emit, within_agent=cfg.router.within_agent,
                                    version_of=self.versions.__getitem__, min_part=cfg.router.min_part,
                                    affinity_bound=cfg.router.affinity_bound, seed=cfg.run.seed,
                                    instance_expected=lambda: restarting("rollout") or self.rejoin.pending())
        self.weights = WeightSync(self.agents, server, self.instances, self.versions, emit,
                                  trainer_for=self._trainer_for, lora=self.lora,
                                  ranks={a: self.units[self.unit_of[a]].ranks for a in self.agents})
        self.admission = Admission(self.instances, self.weights, self.versions, server, self.load_model_message)
        if resume is not None:  # rows of batches after the checkpoint are made again
            truncate_metrics(self.run_dir / "metrics.jsonl", resume.step)
            self.schedule.resume_after(resume.step)
            self.versions.resume_at(resume.step)
        trackers = open_trackers(cfg.run.trackers, self.run_dir, to_dict(cfg), self.agents)
        self.tokenizers: dict[str, AgentTokenizer] = {}  # filled in setup, once models are resolved
        self.sample_log = None  # a few trained samples per agent per step, as text (run.samples_per_step)
        if cfg.run.samples_per_step > 0:
            self.sample_log = SampleLog(self.run_dir, cfg.run.samples_per_step, self.tokenizers, trackers,
                                        resumed_after=resume.step if resume is not None else None)
            self.store.on_ready.append(lambda group: self.sample_log.group_ready(
                group.agent, [self.store.samples[sid] for sid in group.sample_ids]))
        self.metrics = MetricsLog(self.run_dir, self.agents, progress=cfg.run.progress, trackers=trackers,
                                  resumed=resume is not None, first_step=self.schedule.first_batch,
                                  sample_log=self.sample_log, prompt_counts=self.client.prompt_counts.__getitem__)
        self.checkpoints = Checkpointer(self.run_dir / "checkpoints", self.agents, every=cfg.run.checkpoint_every,
                                       keep=cfg.run.keep_checkpoints, steps=cfg.run.steps, server=server, emit=emit,
                                       controller_state=self._controller_state,
                                       full_state=cfg.cluster.trainer_group_size == 1)
        d = cfg.data
        self.dataset = _dataset("data.train", d.train, cfg.run.seed, d.shuffle, d.epochs) if d.train else None
        if self.dataset is not None:
            self.dataset.check_serves(cfg.run.steps * p.queries_per_step, "run.steps x pipeline.queries_per_step")
        # Held-out rows in file order, cycled as often as evaluations ask.
        eval_data = _dataset("data.eval", d.eval, cfg.run.seed, shuffle=False) if d.eval else None
        self.tools = ThreadPoolExecutor(max_workers=p.tool_threads, thread_name_prefix="tool")
        self.endpoint = (OpenAIEndpoint(cfg.openai, {a: bases.model_of(cfg, a) for a in self.agents},
                                        {a: c.tool_parser for a, c in cfg.agents.items()})
                         if cfg.openai.enabled else None)
        self.episodes = EpisodeProducer(cfg, self.workflow, self.store, self.client, self.schedule, emit,
                                        self.dataset, self.tools, self.tokenizers, self.endpoint)
        if resume is not None:
            for change in check_resume(resume, exactness_settings(cfg, self.dataset)):
                log.warning("resuming with a changed setting, as asked: %s", change)
            # The data continues at the saved position, whatever the batch size now.
            saved = resume.state.get("data", {}).get("next_episode", resume.step * p.queries_per_step)
            self.episodes.continue_data(resume.step + 1, saved)
        self.evaluator = Evaluator(cfg, self.workflow, self.client, self.schedule, self.metrics, emit, eval_data,
                                   self.tools, self.tokenizers, self.endpoint)
        self.model_path: dict[str, str] = {}
        self.allocator: TrainerAllocator | None = None
        self.pipelines: dict[str, AgentPipeline] = {}
        self.rebalancer: Rebalancer | None = None
        self.ready = asyncio.Event()  # set once agents are placed and loaded
        self.started = self.wall_s = 0.0
        self.busy: dict[str, float] = {}
        self._loads_at_start: dict[str, float] = {}
        server.on_died.append(self._on_worker_died)
        self.rejoin = Rejoin(self.units, self.instances, self.admission, server,
                             accepting=lambda: self.ready.is_set() and not server.closing,
                             finished=lambda: self.schedule.finished,
                             trainer_joined=lambda worker: self.allocator.trainer_joined(worker))
        server.on_joined.append(self.rejoin.joined)

    @property
    def reassignments(self) -> list:
        return self.rebalancer.reassignments if self.rebalancer is not None else []

    # ------------------------------------------------------------ the loops

    async def run(self) -> RunSummary:
        """Sets up, runs the loops listed in the module docstring until the last batch is
        trained (the first loop to fail stops the others), checkpoints, summarises."""
        p = self.cfg.pipeline
        if self.resume is None:
            self.emit(ev.RunStarted(dump_toml(self.cfg), self.agents, p.mode, p.max_staleness, self.cfg.run.seed))
        else:
            self.emit(ev.RunResumed(self.resume.step, str(self.resume.path), dump_toml(self.cfg)))
        try:
            await self.setup()
            if self.endpoint is not None:
                write_text_atomically(self.run_dir / "openai.url", await self.endpoint.start() + "\n")
            self._loads_at_start = await self._worker_loads()
            self.started = time.monotonic()
            self.metrics.training_started()
            loops = [asyncio.create_task(self.episodes.run(), name="episodes"),
                     asyncio.create_task(self.rejoin.run(), name="rejoin"),
                     *(asyncio.create_task(pl.run(), name=f"train-{a}") for a, pl in self.pipelines.items())]
            if self.rebalancer is not None:
                loops.append(asyncio.create_task(self.rebalancer.run(), name="balance"))
            if self.cfg.eval.every > 0:
                loops.append(asyncio.create_task(self.evaluator.run(), name="eval"))
            await supervise(loops, watch=[self.endpoint.task] if self.endpoint is not None else ())
        finally:  # in order: nothing of the loops or the endpoint is left under way, then what they used closes
            if self.endpoint is not None:
                await self.endpoint.stop()
            await self.client.close()
            self.tools.shutdown(wait=False, cancel_futures=True)
            self.metrics.close()
            if self.allocator is not None:
                await self.allocator.close()
        self.wall_s = time.monotonic() - self.started
        self.emit(ev.RunFinished(self.cfg.run.steps, self.wall_s))
        self.busy = await self._busy_fractions()
        steps = self.cfg.run.steps - (self.schedule.first_batch - 1)  # in this process (after a resume: the rest)
        return RunSummary(steps, self.wall_s, self.samples_trained, self.tokens_trained,
                          self.episodes.failed, self.metrics.reward_history(), str(self.run_dir))

    @property
    def samples_trained(self) -> int:
        return sum(pl.samples_trained for pl in self.pipelines.values())

    @property
    def tokens_trained(self) -> int:
        return sum(pl.tokens_trained for pl in self.pipelines.values())

    # ------------------------------------------------------------ set-up

    async def setup(self) -> None:
        cfg = self.cfg
        display = SetupProgress(cfg.run.progress)
        for agent in self.agents:
            def building(name: str, agent: str = agent) -> Any:
                return display.stage(f"building model {name} for agent {agent} (first use only: it is cached)")
            self.model_path[agent] = await asyncio.to_thread(resolve_model, bases.model_of(cfg, agent), None,
                                                             building)
            if self.lora[agent] is not None:  # before any engine or trainer loads the base
                check_lora_targets(agent, list(self.lora[agent].target_modules), self.model_path[agent])
        with display.stage(f"loading the tokenizers of {len(self.agents)} agents") as stage:
            for agent in self.agents:
                if has_tokenizer(self.model_path[agent]):  # for text and chat in workflows
                    self.tokenizers[agent] = await asyncio.to_thread(AgentTokenizer, agent, self.model_path[agent])
                stage.update(len(self.tokenizers), len(self.agents))
        # Engine units are placed (a base's instances serve all its agents); each agent is
        # routed over its unit's instances.
        weight = {name: sum(self._expected_tokens(a) for a in u.agents) for name, u in self.units.items()}
        placement = decisions.place_agents(list(self.units), self.worker_ids("rollout"), weight)
        saved = self.resume.state.get("rollout_assignment") if self.resume else None
        if saved and sorted({w for ws in saved.values() for w in ws}) == sorted(self.worker_ids("rollout")):
            placement = {name: list(saved[u.agents[0]]) for name, u in self.units.items()}  # as at the checkpoint
        log.info("rollout placement: %s", placement)
        self.instances.place(placement)
        self.allocator = TrainerAllocator(self.server, self.worker_ids("trainer"), cfg.cluster.trainer_capacity,
                                          cfg.agents, self.model_path, cfg.run.seed, self._work, self.emit,
                                          settings={a: bases.trainer_settings(cfg, a) for a in self.agents},
                                          lora=self.lora, saves_parked=cfg.cluster.trainer_group_size == 1)
        self.allocator.on_parked.append(self.weights.forget)
        if self.resume is not None:
            for agent in self.agents:
                self.allocator.recover(agent, self.resume.training_state(agent), self.resume.step,
                                       self.resume.training_state_checksum(agent))
        lanes = TrainerLanes()  # the order of every trainer's commands, for every agent
        self.pipelines = {a: AgentPipeline(a, cfg.pipeline, self.store, self.schedule, self.allocator, self.weights,
                                           self.server, self.metrics, self.emit, self.flush_events,
                                           cfg.agents[a].loss_options(), checkpoints=self.checkpoints, lanes=lanes)
                          for a in self.agents}
        if cfg.router.across_agents:
            self.rebalancer = Rebalancer(cfg.router, self.units, self.instances, self.admission, self.client,
                                         self.server, self.weights,
                                         {name: self.model_path[u.agents[0]] for name, u in self.units.items()},
                                         self.emit, lambda: self.schedule.finished)
        engines = [(u, w) for u, ws in placement.items() for w in ws]
        with display.stage(f"starting {len(engines)} rollout engines and {len(self.agents)} training states") as stage:
            stage.update(0, len(engines) + 1)

            async def counted(work: Awaitable[Any]) -> Any:
                result = await work
                stage.update((stage.done or 0) + 1)
                return result

            admitted = await asyncio.gather(*(counted(self._place(a, w)) for a, w in engines),
                                            counted(self._init_agents()))
        if not all(admitted[:-1]):
            raise RuntimeError("a rollout worker died or failed while starting its engine at set-up; see its log "
                               "in the run directory's logs/ folder")
        self.ready.set()

    async def _init_agents(self) -> None:
        for agent in self.agents:  # in order: with limited capacity, later ones park earlier ones
            await self.allocator.acquire(agent)
            self.allocator.release(agent)

    @contextlib.asynccontextmanager
    async def _trainer_for(self, agent: str):
        trainer = await self.allocator.acquire(agent)
        try:
            yield trainer
        finally:
            self.allocator.release(agent)

    def _work(self, agent: str) -> decisions.AgentWork:
        pipeline = self.pipelines.get(agent)
        return pipeline.work() if pipeline is not None else decisions.AgentWork()

    def _expected_tokens(self, agent: str) -> float:
        # Rough demand for the initial placement: requests multiply down a chain, so use
        # configured group size x output length; the router corrects with measurements.
        a = self.cfg.agents[agent]
        return a.group_size * a.max_tokens * (1 + self.agents.index(agent))

    async def _place(self, unit: str, worker: str) -> bool:
        message = self.load_model_message(unit)
        u = self.units[unit]
        if self.resume is not None and not u.lora:  # a resumed run: engines start at the checkpoint
            message = msgspec.structs.replace(message, model_path=str(self.resume.agent_dir(u.agents[0]).resolve()),
                                              version=self.resume.step,
                                              checksums=self.resume.agent_checksums(u.agents[0]))
        return await self.admission.admit(worker, unit, engine=message, why="joins: initial placement")

    def load_model_message(self, unit: str) -> protocol.LoadModel:
        """What starts an engine of `unit` on its model at version 0, the model directory's
        weights; the weight sync brings it to the agent's version (a rejoined worker, an
        instance moved between units). Never a checkpoint's: those get pruned. A base's
        engine has LoRA slots, named as the unit; its agents' adapters are loaded next (the
        admission)."""
        u = self.units[unit]
        return u.load_message(self.server.next_request_id(), self.model_path[u.agents[0]], self.cfg.run.seed)

    def _on_worker_died(self, info: Any) -> None:
        if self.server.closing:  # workers leaving after SHUTDOWN
            return
        self.instances.died(info.worker_id)
        if self.allocator is not None and info.worker_id in self.allocator.trainers:
            lost = self.allocator.trainer_died(info.worker_id)
            if lost:
                log.warning("trainer %s died holding %s; each is restored from its last saved state and "
                            "trained again from there", info.worker_id, ", ".join(lost))

    # ------------------------------------------------------------ measurements and checkpoints

    def stage_times(self) -> dict[str, float]:
        return self.schedule.stage_times()

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

    def _controller_state(self, step: int) -> dict[str, Any]:
        past = collections.Counter(s.agent for s in self.store.samples.values() if s.batch > step)
        after_cut = {a: past[a] for a in self.agents}  # one pass over the samples, not one per agent
        return controller_state(self.cfg, step, self.instances.assignment, after_cut, self.dataset,
                                self.episodes.episode_number(step + 1, 0))


def whole_model_message(cfg: ExperimentConfig, agent: str, request_id: int, path: str,
                        version: int = 0) -> protocol.LoadModel:
    """What starts an engine on a whole-model agent's weights in `path`, as `version`."""
    return bases.engine_units(cfg)[agent].load_message(request_id, path, cfg.run.seed, version)


def _dataset(key: str, path: str, seed: int, shuffle: bool, epochs: int = 0) -> Dataset:
    try:
        return Dataset.from_path(path, seed, shuffle, epochs, name=key)
    except DataError as exc:
        raise DataError(f"{key}: {exc}") from None


def truncate_metrics(path: Path, step: int) -> None:
    """Drops metrics rows a resumed run writes again: training rows after `step`, and
    evaluations from `step` on (one at `step` may have been cut short). Atomic."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line torn by the crash
            continue
        limit = step - 1 if row.get("kind") == "eval" else step
        if row.get("step", 0) <= limit:
            kept.append(line)
    write_text_atomically(path, "".join(line + "\n" for line in kept))
