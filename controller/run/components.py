"""The wiring root: every component of a training run, made once, in one place.

In order:

1. `resolve(cfg)`: what the components are made from, checked and loaded: the workflow,
   the engine units, the datasets, each agent's model directory (a tiny model is built on
   first use) and tokenizer. A bad name fails here, before any worker starts.
2. `build(cfg, resolved, given)`: makes every component, each handed what it needs, and
   returns them as one frozen `Components`. `given` is what the run is handed from outside
   (the server, the run directory, the event log's `emit`, the checkpoint it resumes from).
3. At set-up (`TrainingRun.setup`), once the workers registered: the trainers join the
   allocator's pool and the rollout instances are placed, through the components' own
   methods. Nothing is filled in later.

To add a component: make it in `build` (or a helper of it) after what it uses, add a field
to `Components`, and if it has a loop, start it in `TrainingRun.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from flexmarl.runtime import bases, protocol
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import ExperimentConfig, to_dict
from flexmarl.runtime.model_specs import has_tokenizer

from ..control.interfaces import Emit
from ..control.server import ControllerServer
from ..episodes.data import DataError, Dataset
from ..episodes.evaluation import Evaluator
from ..episodes.producer import EpisodeProducer
from ..episodes.tokens import AgentTokenizer
from ..episodes.user_code import load_workflow, workflow_reference
from ..episodes.workflow import ToolPool
from ..environments.client import EnvClient
from ..records.metrics import MetricsLog
from ..records.progress import SetupProgress
from ..records.sample_log import SampleLog
from ..records.trackers import open_trackers
from ..rollout.admission import Admission
from ..rollout.balance_loop import Rebalancer
from ..rollout.rejoin import Rejoin
from ..rollout.router import RolloutClient
from ..serving.openai_api import OpenAIEndpoint
from ..state.instances import RolloutInstances
from ..state.schedule import BatchSchedule
from ..state.store import ExperienceStore
from ..state.versions import SyncedVersions
from ..train.allocator import TrainerAllocator
from ..train.checkpoints import Checkpointer, ResumePoint, continue_episodes, controller_state, resume_counters
from ..train.pipeline import AgentPipeline
from ..train.trainer_lanes import TrainerLanes
from ..weights.sync import WeightSync
from .lora_targets import check_lora_targets
from .model_resolution import TINY_PREFIX, check_model, resolve_model

log = logging.getLogger("flexmarl.components")


@dataclass(frozen=True)
class Resolved:
    """What the config names, checked and loaded."""

    workflow: Callable[..., Any]
    units: bases.Units  # what one rollout engine serves: a whole-model agent, or a base's adapter agents
    model_path: dict[str, str]  # agent -> its model's directory (an adapter agent: its base's)
    tokenizers: dict[str, AgentTokenizer]  # agents whose model has a tokenizer (text and chat in workflows)
    dataset: Dataset | None  # data.train; None: the workflow makes its own queries
    eval_data: Dataset | None  # data.eval, in file order; None: no held-out rows

    def load_message(self, unit: str, request_id: int, seed: int) -> protocol.LoadModel:
        """What starts an engine of `unit` on its model at version 0, the model directory's
        weights; the weight sync brings it to the agent's version (a rejoined worker, an
        instance moved between units). Never a checkpoint's: those get pruned. A base's
        engine has LoRA slots, named as the unit; its agents' adapters are loaded next (the
        admission)."""
        u = self.units[unit]
        return u.load_message(request_id, self.model_path[u.agents[0]], seed)


@dataclass(frozen=True)
class Given:
    """What a run is handed from outside: the controller's server and event log, where it
    writes, and what it continues from."""

    server: ControllerServer
    run_dir: Path
    emit: Emit
    flush_events: Callable[[], Awaitable[None]]
    resume: ResumePoint | None = None  # continue from this checkpoint, not the models' initial weights
    restarting: Callable[[str], bool] = lambda role: False  # a started worker of the role is on its way back


@dataclass(frozen=True)
class Components:
    """Every component of a training run (see the module docstring for the order)."""

    resolved: Resolved
    store: ExperienceStore
    versions: SyncedVersions
    schedule: BatchSchedule
    instances: RolloutInstances
    allocator: TrainerAllocator
    weights: WeightSync
    admission: Admission
    ready: asyncio.Event  # set once the agents are placed and loaded: rejoins are accepted from then on
    rejoin: Rejoin
    client: RolloutClient
    metrics: MetricsLog
    checkpoints: Checkpointer
    tools: ThreadPoolExecutor  # workflows' tool calls, where there is no environment worker
    environments: EnvClient  # workflows' tool calls on environment workers (cluster.env_workers)
    endpoint: OpenAIEndpoint | None  # only with openai.enabled (never made later)
    episodes: EpisodeProducer
    evaluator: Evaluator  # its loop runs when eval.every > 0
    pipelines: dict[str, AgentPipeline]
    rebalancer: Rebalancer  # its loop runs with router.across_agents
    load_message: Callable[[str], protocol.LoadModel]  # unit -> what starts its engine (Resolved.load_message)


# ------------------------------------------------------------ 1. resolve


def resolve(cfg: ExperimentConfig) -> Resolved:
    """Checks every name the config gives (agents, workflow, models, LoRA targets, data)
    and loads what they name; builds a tiny model on its first use."""
    agents = list(cfg.agents)
    if not agents:
        raise ValueError("the config defines no agents ([agents.NAME] tables)")
    workflow = load_workflow(cfg.run.workflow)
    for agent in agents:  # a model name that names nothing fails before anything is built
        check_model(bases.model_of(cfg, agent))
        if cfg.agents[agent].base and not bases.model_of(cfg, agent).startswith(TINY_PREFIX):
            # a base given as a directory: its modules are known before any model is built
            check_lora_targets(agent, cfg.agents[agent].lora_target_modules, bases.model_of(cfg, agent))
    d = cfg.data
    dataset = _dataset("data.train", d.train, cfg.run.seed, d.shuffle, d.epochs) if d.train else None
    if dataset is not None:
        dataset.check_serves(cfg.run.steps * cfg.pipeline.queries_per_step, "run.steps x pipeline.queries_per_step")
    eval_data = _dataset("data.eval", d.eval, cfg.run.seed, shuffle=False) if d.eval else None  # cycled as asked
    units = bases.engine_units(cfg)
    model_path = _model_paths(cfg, units)
    return Resolved(workflow, units, model_path, _tokenizers(cfg, model_path), dataset, eval_data)


def _model_paths(cfg: ExperimentConfig, units: bases.Units) -> dict[str, str]:
    display = SetupProgress(cfg.run.progress)
    paths = {}
    for agent in cfg.agents:
        def building(name: str, agent: str = agent) -> Any:
            return display.stage(f"building model {name} for agent {agent} (first use only: it is cached)")
        paths[agent] = resolve_model(bases.model_of(cfg, agent), None, building)
        lora = units.lora(agent)
        if lora is not None:  # before any engine or trainer loads the base
            check_lora_targets(agent, list(lora.target_modules), paths[agent])
    return paths


def _tokenizers(cfg: ExperimentConfig, model_path: dict[str, str]) -> dict[str, AgentTokenizer]:
    tokenizers = {}
    with SetupProgress(cfg.run.progress).stage(f"loading the tokenizers of {len(model_path)} agents") as stage:
        for agent, path in model_path.items():
            if has_tokenizer(path):
                tokenizers[agent] = AgentTokenizer(agent, path)
            stage.update(len(tokenizers), len(model_path))
    return tokenizers


def _dataset(key: str, path: str, seed: int, shuffle: bool, epochs: int = 0) -> Dataset:
    try:
        return Dataset.from_path(path, seed, shuffle, epochs, name=key)
    except DataError as exc:
        raise DataError(f"{key}: {exc}") from None


# ------------------------------------------------------------ 2. build


def build(cfg: ExperimentConfig, resolved: Resolved, given: Given) -> Components:
    """Every component of the run, each made once with what it needs, in dependency order.
    The allocator weighs the pipelines' work and the pipelines use the allocator: the
    allocator reads `pipelines` (filled below, before anything runs) when it weighs."""
    agents, server, emit, units = list(cfg.agents), given.server, given.emit, resolved.units
    store = ExperienceStore(agents, emit=emit, std_normalized={a: c.normalize_adv_std for a, c in cfg.agents.items()})
    versions = SyncedVersions(agents)
    schedule = BatchSchedule(agents, cfg.run.steps, cfg.pipeline.queries_per_step,
                             overlap=cfg.pipeline.mode == "async", max_staleness=cfg.pipeline.max_staleness,
                             versions=versions)
    store.on_ready.append(lambda key: schedule.work_arrived(key.agent))
    instances = RolloutInstances(units, emit)
    pipelines: dict[str, AgentPipeline] = {}
    allocator = TrainerAllocator(server, [], cfg.cluster.trainer_capacity, cfg.agents, resolved.model_path,
                                 cfg.run.seed, lambda agent: pipelines[agent].work(), emit,
                                 settings={a: bases.trainer_settings(cfg, a) for a in agents},
                                 lora={a: units.lora(a) for a in agents},
                                 saves_parked=cfg.cluster.trainer_group_size == 1)
    weights = WeightSync(agents, server, instances, versions, emit, trainer_for=_trainer_for(allocator),
                         lora={a: units.lora(a) for a in agents}, ranks={a: units.of(a).ranks for a in agents},
                         in_flight=cfg.in_flight())
    allocator.on_parked.append(weights.forget)
    def load_message(unit: str) -> protocol.LoadModel:
        return resolved.load_message(unit, server.next_request_id(), cfg.run.seed)
    admission = Admission(instances, weights, versions, server, load_message)
    ready = asyncio.Event()
    rejoin = Rejoin(units, instances, admission, server, accepting=lambda: ready.is_set() and not server.closing,
                    finished=lambda: schedule.finished, trainer_joined=allocator.trainer_joined)
    # Requests wait for an instance while one is on its way back: a rollout worker being
    # restarted by the launcher (`restarting`), or registered again and being admitted.
    client = RolloutClient(server, instances, emit=emit, within_agent=cfg.router.within_agent,
                           version_of=versions.__getitem__, min_part=cfg.router.min_part,
                           affinity_bound=cfg.router.affinity_bound, seed=cfg.run.seed,
                           instance_expected=lambda: given.restarting("rollout") or rejoin.pending())
    if given.resume is not None:  # before the metrics log opens: it continues after the checkpoint
        resume_counters(given.resume, given.run_dir, schedule, versions)
    metrics = _metrics(cfg, resolved, given, store, schedule, client)
    tools = ThreadPoolExecutor(max_workers=cfg.pipeline.tool_threads, thread_name_prefix="tool")
    environments = EnvClient(server, workflow_reference(cfg.run.workflow), cfg.env,
                             expected=lambda: given.restarting("env"), finished=lambda: schedule.finished)
    # ctx.call runs on environment workers when the run has any, else in the thread pool
    tool_pool = ToolPool(tools, cfg.pipeline.tool_timeout_s, environments if cfg.cluster.env_workers else None)
    endpoint = (OpenAIEndpoint(cfg.openai, {a: bases.model_of(cfg, a) for a in agents},
                               {a: c.tool_parser for a, c in cfg.agents.items()}) if cfg.openai.enabled else None)
    episodes = EpisodeProducer(cfg, resolved.workflow, store, client, schedule, emit, resolved.dataset, tool_pool,
                               resolved.tokenizers, endpoint)
    checkpoints = Checkpointer(given.run_dir / "checkpoints", agents, every=cfg.run.checkpoint_every,
                               keep=cfg.run.keep_checkpoints, steps=cfg.run.steps, server=server, emit=emit,
                               controller_state=lambda step: _run_state(cfg, step, store, instances,
                                                                        resolved.dataset, episodes),
                               full_state=cfg.cluster.trainer_group_size == 1)
    if given.resume is not None:
        continue_episodes(given.resume, cfg, resolved.dataset, episodes)
    evaluator = Evaluator(cfg, resolved.workflow, client, schedule, metrics, emit, resolved.eval_data, tool_pool,
                          resolved.tokenizers, endpoint)
    lanes = TrainerLanes()  # the order of every trainer's commands, for every agent
    pipelines.update({a: AgentPipeline(a, cfg.pipeline, store, schedule, allocator, weights, server, metrics, emit,
                                       given.flush_events, cfg.agents[a].loss_options(), checkpoints=checkpoints,
                                       lanes=lanes) for a in agents})
    rebalancer = Rebalancer(cfg.router, units, instances, admission, client, server, weights,
                            {name: resolved.model_path[u.agents[0]] for name, u in units.items()}, emit,
                            lambda: schedule.finished)
    return Components(resolved, store, versions, schedule, instances, allocator, weights, admission, ready, rejoin,
                      client, metrics, checkpoints, tools, environments, endpoint, episodes, evaluator, pipelines,
                      rebalancer,
                      load_message)


def _run_state(cfg: ExperimentConfig, step: int, store: ExperienceStore, instances: RolloutInstances,
               dataset: Dataset | None, episodes: EpisodeProducer) -> dict[str, Any]:
    """`controller_state` read off the run's components: the store's samples past the cut,
    the rollout instances' assignment, the episode numbering."""
    past = store.samples_past(step)
    return controller_state(cfg, step, instances.assignment, {a: past[a] for a in cfg.agents}, dataset,
                            episodes.episode_number(step + 1, 0))


def _metrics(cfg: ExperimentConfig, resolved: Resolved, given: Given, store: ExperienceStore,
             schedule: BatchSchedule, client: RolloutClient) -> MetricsLog:
    """The metrics log, its trackers and (run.samples_per_step > 0) the sample log it
    writes a few trained samples per agent per step to, as text."""
    resume = given.resume
    trackers = open_trackers(cfg.run.trackers, given.run_dir, to_dict(cfg), list(cfg.agents))
    sample_log = None
    if cfg.run.samples_per_step > 0:
        sample_log = SampleLog(given.run_dir, cfg.run.samples_per_step, resolved.tokenizers, trackers,
                               resumed_after=resume.step if resume is not None else None)
        store.on_ready.append(lambda key: sample_log.group_ready(key.agent, key, store.views(key)))
    return MetricsLog(given.run_dir, list(cfg.agents), progress=cfg.run.progress, trackers=trackers,
                      resumed=resume is not None, first_step=schedule.first_batch, sample_log=sample_log,
                      prompt_counts=client.prompt_counts.__getitem__)


def _trainer_for(allocator: TrainerAllocator) -> Callable[[str], contextlib.AbstractAsyncContextManager[str]]:
    """The trainer holding an agent, for the span of a `with` (the weight sync's source)."""
    @contextlib.asynccontextmanager
    async def trainer_for(agent: str) -> AsyncIterator[str]:
        trainer = await allocator.acquire(agent)
        try:
            yield trainer
        finally:
            allocator.release(agent)
    return trainer_for
