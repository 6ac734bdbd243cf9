"""`flexmarl serve RUN_DIR` (or one checkpoint of it): the trained agents behind the same
OpenAI API the run served, for trying them with any client.

    flexmarl serve runs/20260101-120000                      # the run's last checkpoint
    flexmarl serve runs/20260101-120000/checkpoints/step-000020 --port 8000

`ServedAgents.run()` starts one rollout worker per agent on this host, loads each agent's
weights from the checkpoint (a checkpoint's agent directory is a model: weights and
tokenizer) at the checkpoint's step as its version, then serves the endpoint
(openai_api.py) until interrupted, and shuts its workers down under a time limit. The
endpoint's key is `openai.key_env`'s (any key is accepted on loopback without one).

Every call is a session of its own: its messages are rendered afresh (nothing is
trained, so no earlier reply needs its engine ids), `n` samples (default 1) at the call's
own settings, through the same episode context and rollout client as training.

It trains nothing and writes nothing but the workers' logs (RUN_DIR/serve-logs/).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from pathlib import Path
from typing import Any, Sequence

from flexmarl.runtime import bases
from flexmarl.runtime.aio import supervise
from flexmarl.runtime.config import ConfigError, ExperimentConfig, load_config
from flexmarl.runtime.model_specs import has_tokenizer

from ..control.server import ControllerServer
from ..episodes.producer import EpisodeContexts
from ..episodes.tokens import AgentTokenizer
from ..launch.launcher import LocalWorkers
from ..rollout.router import RolloutClient
from ..serving.openai_api import OpenAIEndpoint
from ..serving.openai_turns import OpenAITurns
from ..state.instances import RolloutInstances
from ..state.store import ExperienceStore
from ..train.checkpoints import CheckpointError, ResumePoint, latest_checkpoint
from .model_resolution import resolve_model
from .training import whole_model_message


def served_checkpoint(target: str | Path) -> tuple[Path, ResumePoint]:
    """The run directory and the checkpoint that `target` (a run directory or one of its
    checkpoints) names."""
    target = Path(target).resolve()
    run_dir = target.parent.parent if target.parent.name == "checkpoints" else target
    if not (run_dir / "config.toml").exists():
        raise CheckpointError(f"{target} is neither a run directory nor one of its checkpoints (no config.toml in "
                              f"{run_dir})")
    if run_dir == target:
        point = latest_checkpoint(run_dir)
        if point is None:
            raise CheckpointError(f"{run_dir} has no complete checkpoint to serve")
        return run_dir, point
    step = int(target.name.rsplit("-", 1)[-1]) if target.name.startswith("step-") else None
    if step is None or not target.is_dir():
        raise CheckpointError(f"{target} is not a checkpoint (checkpoints/step-NNNNNN)")
    return run_dir, ResumePoint(target, step, {})


class ServedAgents:
    def __init__(self, target: str | Path, overrides: Sequence[str] = ()) -> None:
        self.run_dir, self.point = served_checkpoint(target)
        self.cfg: ExperimentConfig = load_config(self.run_dir / "config.toml", list(overrides))
        adapters = [a for a, c in self.cfg.agents.items() if c.base]
        if adapters:
            raise ConfigError(f"flexmarl serve loads whole models; {', '.join(adapters)} are LoRA adapters of a base "
                              f"(serve the base with vLLM's own server and the adapters in the checkpoint)")
        self.models = {a: self._model_dir(a) for a in self.cfg.agents}
        for agent, path in self.models.items():
            if not has_tokenizer(path):
                raise CheckpointError(f"{path} holds no model with a tokenizer for agent {agent}")
        self.cfg.openai = dataclasses.replace(self.cfg.openai, enabled=True)
        self.server = ControllerServer(self.cfg.transport)
        self.instances = RolloutInstances(bases.engine_units(self.cfg))
        self.client = RolloutClient(self.server, self.instances, within_agent=self.cfg.router.within_agent,
                                    version_of=lambda agent: self.point.step)
        self.tokenizers: dict[str, AgentTokenizer] = {}
        self.endpoint = OpenAIEndpoint(self.cfg.openai, self.models, {a: c.tool_parser for a, c in self.cfg.agents.items()},
                                       serving=self.session)
        self.contexts = EpisodeContexts(self.cfg, self.client, None, self.tokenizers, self.endpoint)
        self._calls = itertools.count()

    def _model_dir(self, agent: str) -> str:
        """Where the served agent's weights are: its checkpoint's directory; a frozen agent's
        own model (a checkpoint names it, never copies it); a snapshot's source's checkpoint."""
        c = self.cfg.agents[agent]
        if c.snapshot_of:
            return str(self.point.agent_dir(c.snapshot_of))
        if not c.train:
            return resolve_model(c.model)
        return str(self.point.agent_dir(agent))

    def session(self) -> Any:
        """One call's context: a store of its own that nothing trains from."""
        ctx = self.contexts.make(f"serve{next(self._calls)}", 0, random.Random(), ExperienceStore(list(self.cfg.agents)),
                                 None, trains=False)
        return OpenAITurns(ctx, self.endpoint, self.endpoint.key)

    async def run(self) -> None:
        address = self.server.bind()
        background = [asyncio.create_task(self.server.serve(), name="receive"),
                      asyncio.create_task(self.server.heartbeat(), name="heartbeat")]
        workers = LocalWorkers(address, self.run_dir / "serve-logs", curve_dir=self.cfg.transport.curve_dir,
                               threads=self.cfg.cluster.threads_per_worker)
        try:
            names = {agent: f"serve-{i}" for i, agent in enumerate(self.cfg.agents)}
            for worker in names.values():
                workers.start("rollout", worker, None)
            await self.server.wait_for_workers({"rollout": len(names), "trainer": 0},
                                               self.cfg.cluster.worker_start_timeout_s)
            await asyncio.gather(*(self._load(agent, worker) for agent, worker in names.items()))
            url = await self.endpoint.start()
            assert self.endpoint.task is not None  # start() made it
            print(f"serving {', '.join(self.models)} (step {self.point.step} of {self.run_dir}) at {url}", flush=True)
            await supervise([self.endpoint.task], watch=background, forever=True)
        finally:
            await self._shut_down(workers, background)

    async def _load(self, agent: str, worker: str) -> None:
        path = self.models[agent]
        self.tokenizers[agent] = await asyncio.to_thread(AgentTokenizer, agent, path)
        message = whole_model_message(self.cfg, agent, self.server.next_request_id(), path, self.point.step)
        await self.server.call(worker, message)
        self.instances.engine_started(worker, agent, self.point.step)
        self.instances.serve(worker, agent, "serves the checkpoint")

    async def _shut_down(self, workers: LocalWorkers, background: list[asyncio.Task]) -> None:
        timeout = self.cfg.cluster.shutdown_timeout_s
        await self.endpoint.stop()
        await self.server.shut_down_workers("serving ended", timeout)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        self.server.close()
        await asyncio.to_thread(workers.stop, timeout, min(5.0, timeout))
