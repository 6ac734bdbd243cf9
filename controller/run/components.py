"""The wiring root: every component of a training run, made once, in one place.

In order:

1. `resolve(cfg, run_dir)`: what the components are made from, checked and loaded: the
   workflow, the engine units, the datasets (and the fields the workflow reads of them,
   dry_read.py), each agent's model directory (a tiny model is built on first use; an
   adapter base built so is kept in the run directory, run_bases.py) and tokenizer. A bad
   name fails here, before any worker starts, and before any model is built.
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
from flexmarl.runtime.config import ConfigError, ExperimentConfig, admits_continuously, to_dict, trained_agents
from flexmarl.runtime.model_specs import default_model_cache, has_tokenizer

from ..control.interfaces import Emit
from ..control.server import ControllerServer
from ..episodes.data import DataError, Dataset
from ..episodes.dry_read import check_fields
from ..episodes.evaluation import Evaluator
from ..episodes.producer import EpisodeProducer
from ..episodes.tokens import AgentTokenizer
from ..episodes.user_code import load_workflow, workflow_reference
from ..episodes.workflow import AgentDefaults, ToolPool
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
from .model_resolution import TINY_PREFIX, check_model, resolve_model, tensor_names
from .run_bases import keep_base, kept_base

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


def resolve(cfg: ExperimentConfig, run_dir: Path | None = None) -> Resolved:
    """Checks every name the config gives (agents, workflow, models, LoRA targets, data,
    the fields the workflow reads) before anything is built, then loads what they name;
    builds a tiny model on its first use. With `run_dir`, the bases built from recipes are
    kept there (run_bases.py), and a base the run keeps already is used as it is."""
    agents = list(cfg.agents)
    if not agents:
        raise ValueError("the config defines no agents ([agents.NAME] tables)")
    workflow = load_workflow(cfg.run.workflow)
    kept = {b: path for b in cfg.bases if run_dir is not None and (path := kept_base(run_dir, b)) is not None}
    for agent in agents:  # a model name that names nothing, or a target its base lacks, fails before any build
        a = cfg.agents[agent]
        if a.base in kept:
            continue
        check_model(bases.model_of(cfg, agent))
        if a.base:
            check_lora_targets(agent, a.lora_target_modules, cfg.bases[a.base].model,
                               tensor_names(cfg.bases[a.base].model))
    d = cfg.data
    dataset = _dataset("data.train", d.train, cfg.run.seed, d.shuffle, d.epochs) if d.train else None
    if dataset is not None:
        dataset.check_serves(cfg.run.steps * cfg.pipeline.queries_per_step, "run.steps x pipeline.queries_per_step")
    eval_data = _dataset("data.eval", d.eval, cfg.run.seed, shuffle=False) if d.eval else None  # cycled as asked
    defaults = {a: AgentDefaults.of(c) for a, c in cfg.agents.items()}
    for data in (dataset, eval_data):
        if data is not None:
            check_fields(workflow, data, defaults, cfg.run.seed)
    units = bases.engine_units(cfg)
    model_path = _model_paths(cfg, kept, run_dir)
    tokenizers = _tokenizers(cfg, model_path)
    _check_teachers(cfg, model_path, tokenizers)
    _check_frozen_adapters(cfg)
    return Resolved(workflow, units, model_path, tokenizers, dataset, eval_data)


def _check_teachers(cfg: ExperimentConfig, model_path: dict[str, str], tokenizers: dict[str, AgentTokenizer]) -> None:
    """A teacher scores its student's token ids as they are: both must read them alike, so
    they share one tokenizer (the same vocabulary, ids and special tokens)."""
    for student, agent in cfg.agents.items():
        if not agent.teacher:
            continue
        mine, theirs = (_vocabulary(tokenizers.get(a), model_path[a]) for a in (student, agent.teacher))
        if mine != theirs:
            raise ConfigError(f"agents.{student}.teacher = {agent.teacher!r}, whose tokenizer differs from "
                              f"{student}'s ({_difference(mine, theirs)}); a teacher scores the student's own token "
                              f"ids, so both models must share one tokenizer")


def _check_frozen_adapters(cfg: ExperimentConfig) -> None:
    """A frozen adapter agent's directory holds a PEFT adapter of its configured rank (the
    engines' LoRA slots are sized from the config)."""
    import json

    for name, agent in cfg.agents.items():
        if not agent.adapter:
            continue
        where = Path(agent.adapter)
        try:
            rank = json.loads((where / "adapter_config.json").read_text())["r"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"agents.{name}.adapter = {agent.adapter!r} is no PEFT adapter directory "
                              f"(adapter_config.json with its rank r, adapter_model.safetensors): {exc}") from None
        if not (where / "adapter_model.safetensors").is_file():
            raise ConfigError(f"agents.{name}.adapter = {agent.adapter!r} has no adapter_model.safetensors")
        if rank != agent.lora_rank:
            raise ConfigError(f"agents.{name}.adapter has rank {rank}, agents.{name}.lora_rank is {agent.lora_rank}: "
                              f"set agents.{name}.lora_rank = {rank}")


def _vocabulary(tokenizer: AgentTokenizer | None, path: str) -> dict[str, Any]:
    if tokenizer is not None:
        return {"vocabulary": tokenizer.tok.get_vocab(), "special tokens": tokenizer.tok.all_special_ids}
    import json
    return {"vocabulary size": json.loads((Path(path) / "config.json").read_text()).get("vocab_size")}


def _difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    key = next((k for k in mine if mine[k] != theirs.get(k)), "")
    if not key or key not in theirs:
        return "one has a tokenizer, the other none"
    sizes = [len(v) if key == "vocabulary" else v for v in (mine[key], theirs[key])]
    return f"{key}: {sizes[0]} against {sizes[1]}" if sizes[0] != sizes[1] else f"{key}: other ids"


def _model_paths(cfg: ExperimentConfig, kept: dict[str, Path], run_dir: Path | None) -> dict[str, str]:
    """Each agent's model directory, each model resolved once (a base once for all its
    agents) and its build shown under the name of what uses it."""
    display, cache = SetupProgress(cfg.run.progress), _shown(default_model_cache())
    users: dict[str, list[str]] = {}  # model name -> the agents that use it
    for agent in cfg.agents:
        users.setdefault(bases.model_of(cfg, agent), []).append(agent)
    paths: dict[str, str] = {}
    for name, agents in users.items():
        base = cfg.agents[agents[0]].base
        who = f"base {base} (agents {', '.join(agents)})" if base else f"agent {', '.join(agents)}"
        if base in kept:
            path = str(kept[base])
            log.info("model of %s: %s (kept in the run directory)", who, path)
        else:
            def building(model: str, who: str = who) -> Any:
                return display.stage(f"building model {model} for {who} (once per machine, cached in {cache})")
            path = resolve_model(name, None, building)
            if base and run_dir is not None and name.startswith(TINY_PREFIX):  # adapters name the kept base
                path = str(keep_base(run_dir, base, path))
            log.info("model of %s: %s", who, path)
        paths.update(dict.fromkeys(agents, path))
    return paths


def _shown(path: Path) -> str:
    """A path as a user reads it: under the home directory, from ~."""
    try:
        return f"~/{path.expanduser().absolute().relative_to(Path.home())}"
    except ValueError:
        return str(path)


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
    trained = trained_agents(cfg)  # the others are frozen: served, never trained, never synced
    snapshots = {a: (c.snapshot_of, c.snapshot_every) for a, c in cfg.agents.items() if c.snapshot_of}
    store = ExperienceStore(agents, emit=emit, std_normalized={a: c.normalize_adv_std for a, c in cfg.agents.items()},
                            frozen=[a for a in agents if a not in trained],
                            dynamic=[a for a, c in cfg.agents.items() if c.dynamic_sampling],
                            teachers={a: c.teacher for a, c in cfg.agents.items() if c.teacher},
                            assigned_at_end=admits_continuously(cfg.pipeline.admission))
    versions = SyncedVersions(agents)
    instances = RolloutInstances(units, emit)
    schedule = BatchSchedule(trained, cfg.run.steps, cfg.pipeline.queries_per_step,
                             overlap=cfg.pipeline.mode == "async", max_staleness=cfg.pipeline.max_staleness,
                             versions=versions, snapshots={a: every for a, (_, every) in snapshots.items()},
                             continuous=admits_continuously(cfg.pipeline.admission), spares=cfg.pipeline.partial_rollout,
                             drained=instances.drained if cfg.pipeline.admission == "capacity" else None)
    store.on_ready.append(lambda key: pipelines[key.agent].group_ready())  # only trained agents' become ready
    instances.on_drained.append(schedule.instance_drained)
    pipelines: dict[str, AgentPipeline] = {}
    allocator = TrainerAllocator(server, [], cfg.cluster.trainer_capacity, {a: cfg.agents[a] for a in trained},
                                 resolved.model_path, cfg.run.seed, lambda agent: pipelines[agent].work(), emit,
                                 settings={a: bases.trainer_settings(cfg, a) for a in trained},
                                 lora={a: units.lora(a) for a in trained},
                                 saves_parked=cfg.cluster.trainer_group_size == 1)
    weights = WeightSync(agents, server, instances, versions, emit, trainer_for=_trainer_for(allocator),
                         lora={a: units.lora(a) for a in agents}, ranks={a: units.of(a).ranks for a in agents},
                         snapshots=snapshots, adapter_dirs={a: c.adapter for a, c in cfg.agents.items() if c.adapter},
                         in_flight=cfg.in_flight())
    allocator.on_parked.append(weights.forget)
    def load_message(unit: str) -> protocol.LoadModel:
        return resolved.load_message(unit, server.next_request_id(), cfg.run.seed)
    admission = Admission(instances, weights, versions, server, load_message)
    ready = asyncio.Event()
    rejoin = Rejoin(units, instances, admission, server, accepting=lambda: ready.is_set() and not server.closing,
                    finished=lambda: schedule.finished, trainer_joined=allocator.trainer_joined,
                    closing=lambda: server.closing)
    # Requests wait for an instance while one is on its way back: a rollout worker being
    # restarted by the launcher (`restarting`), or registered again and being admitted.
    client = RolloutClient(server, instances, emit=emit, within_agent=cfg.router.within_agent,
                           version_of=versions.__getitem__, min_part=cfg.router.min_part,
                           affinity_bound=cfg.router.affinity_bound, seed=cfg.run.seed,
                           coalesce_tokens=cfg.router.coalesce_tokens,
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
    checkpoints = Checkpointer(given.run_dir / "checkpoints", trained, every=cfg.run.checkpoint_every,
                               keep=cfg.run.keep_checkpoints, steps=cfg.run.steps, server=server, emit=emit,
                               controller_state=lambda step: _run_state(cfg, step, store, instances,
                                                                        resolved.dataset, episodes, versions),
                               full_state=cfg.cluster.trainer_group_size == 1)
    if given.resume is not None:
        continue_episodes(given.resume, cfg, resolved.dataset, episodes)
    evaluator = Evaluator(cfg, resolved.workflow, client, schedule, metrics, emit, resolved.eval_data, tool_pool,
                          resolved.tokenizers, endpoint)
    lanes = TrainerLanes()  # the order of every trainer's commands, for every agent
    pipelines.update({a: AgentPipeline(a, cfg.pipeline, store, schedule, allocator, weights, server, metrics, emit,
                                       given.flush_events, cfg.agents[a].loss_options(), checkpoints=checkpoints,
                                       lanes=lanes) for a in trained})
    rebalancer = Rebalancer(cfg.router, units, instances, admission, client, server, weights,
                            {name: resolved.model_path[u.agents[0]] for name, u in units.items()}, emit,
                            lambda: schedule.finished)
    return Components(resolved, store, versions, schedule, instances, allocator, weights, admission, ready, rejoin,
                      client, metrics, checkpoints, tools, environments, endpoint, episodes, evaluator, pipelines,
                      rebalancer,
                      load_message)


def _run_state(cfg: ExperimentConfig, step: int, store: ExperienceStore, instances: RolloutInstances,
               dataset: Dataset | None, episodes: EpisodeProducer, versions: SyncedVersions) -> dict[str, Any]:
    """`controller_state` read off the run's components: the store's samples past the cut,
    the rollout instances' assignment, the episode numbering, the synced versions, and
    under continuous admission the episodes in flight."""
    past = store.samples_past(step)
    return controller_state(cfg, step, instances.assignment, {a: past[a] for a in cfg.agents}, dataset,
                            episodes.episode_number(step + 1, 0), versions,
                            episodes.in_flight(step) if admits_continuously(cfg.pipeline.admission) else None)


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
        store.on_served.append(lambda key: sample_log.group_served(key.agent, store.views(key)))
    return MetricsLog(given.run_dir, schedule.agents, progress=cfg.run.progress, trackers=trackers,
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
