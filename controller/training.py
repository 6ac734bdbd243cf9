"""The training driver: set up agents on workers, then iterate rollout -> train -> sync.

Components it wires together (none of them refers back to it):
- `ExperienceStore` (store.py): samples, groups, exactly-once consumption;
- `RolloutClient` (router.py): batched generation requests, routing, re-issue;
- the workflow (workflow.py, workflows.py): user episodes that call agents and reward them;
- `MetricsLog` (metrics.py): metrics.jsonl, progress line, reward plot.

This module holds the sync schedule: roll out the whole global batch, then train each
agent on it (micro-batches, one optimizer step), then publish weights to that agent's
rollout instances. Model resolution and the placement of agents on workers live here too.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flexmarl.runtime import protocol

from .metrics import MetricsLog
from .router import RolloutClient
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
        examples = lambda: tasks.warmup_examples(key, random.Random(f"warmup-{key}"), 4096)  # noqa: E731
        return str(models.ensure_model(tasks.AGENTS[key], cache_root, examples, tasks.WARMUP_VERSION))
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
    times: list[StepTimes] = field(default_factory=list)
    run_dir: str = ""

    def reward_change(self, agent: str, window: int = 3) -> tuple[float, float]:
        r = self.rewards[agent]
        w = max(1, min(window, len(r) // 2))
        return sum(r[:w]) / w, sum(r[-w:]) / w

    def report(self) -> str:
        lines = [f"{self.steps} steps in {self.wall_s:.1f}s: {self.samples / self.wall_s:.1f} samples/s, "
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
        self.store = ExperienceStore(self.agents)
        self.client = RolloutClient(self.server)
        self.trainer_of: dict[str, str] = {}
        self.version = {a: 0 for a in self.agents}
        self.model_path: dict[str, str] = {}
        self.metrics = MetricsLog(exp.run_dir, self.agents, progress=self.cfg.run.progress)
        self.failed_episodes = 0
        self.samples_trained = 0
        self.tokens_trained = 0

    # ------------------------------------------------------------ setup

    async def setup(self) -> None:
        for agent in self.agents:
            spec = self.cfg.agents[agent].model
            self.model_path[agent] = await asyncio.to_thread(resolve_model, spec)
        weight = {a: self._expected_tokens(a) for a in self.agents}
        self.client.assignment = place_agents(self.agents, self.exp.worker_ids("rollout"), weight)
        trainers = self.exp.worker_ids("trainer")
        self.trainer_of = {a: trainers[i % len(trainers)] for i, a in enumerate(self.agents)}
        log.info("placement: rollout %s, trainers %s", self.client.assignment, self.trainer_of)
        await asyncio.gather(*(self._load_model(a, w) for a, ws in self.client.assignment.items() for w in ws),
                             *(self._init_agent(a) for a in self.agents))

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

    async def _init_agent(self, agent: str) -> None:
        a = self.cfg.agents[agent]
        msg = protocol.InitAgent(self.server.next_request_id(), agent, self.model_path[agent], a.lr,
                                 self.cfg.run.seed, a.max_grad_norm)
        await self.server.call(self.trainer_of[agent], msg)

    # ------------------------------------------------------------ the loop

    async def run(self) -> RunSummary:
        started = time.monotonic()
        try:
            await self.setup()
            for step in range(1, self.cfg.run.steps + 1):
                await self.iteration(step)
                if self.cfg.run.checkpoint_every and step % self.cfg.run.checkpoint_every == 0:
                    await self.checkpoint(f"step-{step}")
            await self.checkpoint("final")
        finally:
            self.metrics.close()
        return RunSummary(self.cfg.run.steps, time.monotonic() - started, self.samples_trained,
                          self.tokens_trained, self.failed_episodes, self.metrics.reward_history(),
                          self.metrics.step_times, str(self.exp.run_dir))

    async def iteration(self, step: int) -> None:
        times = StepTimes()
        t0 = time.monotonic()
        await self.rollout(step)
        t1 = time.monotonic()
        times.rollout_s = t1 - t0
        trained = await asyncio.gather(*(self.train_agent(a) for a in self.agents))
        t2 = time.monotonic()
        times.train_s = t2 - t1
        await asyncio.gather(*(self.sync_agent(a) for a in self.agents))
        times.sync_s = time.monotonic() - t2
        for agent, samples in zip(self.agents, trained):
            self.metrics.record(step, agent, self.version[agent], samples, times)
        self.metrics.end_step(step, self.cfg.run.steps, times)

    async def rollout(self, step: int) -> None:
        p = self.cfg.pipeline
        limit = asyncio.Semaphore(p.max_concurrent_episodes)
        defaults = {a: AgentDefaults(c.max_tokens, c.temperature, c.group_size) for a, c in self.cfg.agents.items()}

        async def one(i: int) -> None:
            async with limit:
                ctx = EpisodeContext(f"s{step}q{i}", step, random.Random(f"{self.cfg.run.seed}-{step}-{i}"),
                                     self.store, self.client, defaults, self.cfg.run.seed,
                                     self.cfg.run.env_latency_ms)
                if await run_episode(self.workflow, ctx, p.episode_timeout_s):
                    self.failed_episodes += 1

        await asyncio.gather(*(one(i) for i in range(p.queries_per_step)))

    async def train_agent(self, agent: str) -> list[Sample]:
        samples: list[Sample] = []
        while self.store.ready_samples(agent):
            samples += self.store.take(agent, 1 << 30)
        if not samples:
            log.warning("agent %s has no trainable samples this step (all episodes failed?)", agent)
            return []
        p = self.cfg.pipeline
        version = self.version[agent] + 1
        trainer = self.trainer_of[agent]
        calls = []
        for i in range(0, len(samples), p.micro_batch):
            mb = samples[i:i + p.micro_batch]
            msg = protocol.TrainMicroBatch(self.server.next_request_id(), agent, version,
                                           [_train_sample(s) for s in mb], 1.0 / len(samples),
                                           p.max_staleness, p.clip_ratio)
            calls.append(self.server.call(trainer, msg))
        for reply, _ in await asyncio.gather(*calls):
            self.tokens_trained += reply.tokens
        await self.server.call(trainer, protocol.OptimStep(self.server.next_request_id(), agent, version))
        self.version[agent] = version
        self.samples_trained += len(samples)
        self.store.forget(samples)
        return samples

    async def sync_agent(self, agent: str) -> None:
        instances = self.client.instances(agent)
        version = self.version[agent]
        reply, _ = await self.server.call(self.trainer_of[agent], protocol.PublishWeights(
            self.server.next_request_id(), agent, version, "auto", instances))
        await asyncio.gather(*(self.server.call(w, protocol.LoadWeights(
            self.server.next_request_id(), agent, version, reply.handle)) for w in instances))

    async def checkpoint(self, name: str) -> None:
        root = Path(self.exp.run_dir) / "checkpoints"
        await asyncio.gather(*(self.server.call(self.trainer_of[a], protocol.SaveCheckpoint(
            self.server.next_request_id(), a, str((root / name / a).resolve()))) for a in self.agents))
        log.info("checkpoint %s written to %s", name, root / name)


def _train_sample(s: Sample) -> protocol.TrainSample:
    return protocol.TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage, s.logprobs, s.versions)
