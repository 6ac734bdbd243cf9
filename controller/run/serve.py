"""`flexmarl serve RUN_DIR` (or one checkpoint of it): the trained agents behind the same
OpenAI API the run served, for trying them with any client.

    flexmarl serve runs/20260101-120000                      # the run's last checkpoint
    flexmarl serve runs/20260101-120000/checkpoints/step-000020 --port 8000

`ServedAgents.run()` starts one rollout worker per engine unit on this host, as training
placed them: a whole-model agent's engine on its checkpoint directory (weights and
tokenizer), a base's engine on the base (the one the run kept, run_bases.py, else its
model) with the adapter of each of its agents from the checkpoint, all at the checkpoint's
step as their version. It then serves the endpoint (openai_api.py) until interrupted, and
shuts its workers down under a time limit. The endpoint's key is `openai.key_env`'s (any
key is accepted on loopback without one).

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
import sys
from pathlib import Path
from typing import Any, Sequence

import msgspec

from flexmarl.runtime import bases, protocol
from flexmarl.runtime.aio import StallWatch, supervise
from flexmarl.runtime.checksums import DamagedFile
from flexmarl.runtime.config import ExperimentConfig, load_config
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
from ..train.checkpoints import CheckpointError, ResumePoint, resume_point, verified
from .model_resolution import resolve_model
from .run_bases import kept_base
from .training import whole_model_message


def served_checkpoint(target: str | Path) -> tuple[Path, ResumePoint]:
    """The run directory and the checkpoint that `target` (a run directory or one of its
    checkpoints) names, checked against its manifest as a resume checks it: a run
    directory's newest intact checkpoint (a damaged newer one named and passed over), or
    the one named, refused when a file of it does not match."""
    target = Path(target).resolve()
    run_dir = target.parent.parent if target.parent.name == "checkpoints" else target
    if not (run_dir / "config.toml").exists():
        raise CheckpointError(f"{target} is neither a run directory nor one of its checkpoints (no config.toml in "
                              f"{run_dir})")
    if run_dir == target:
        point = resume_point(run_dir, warn=lambda line: print(f"flexmarl: {line}", file=sys.stderr, flush=True),
                             use=("served", "serving"))
        if point is None:
            raise CheckpointError(f"{run_dir} has no complete checkpoint to serve")
        return run_dir, point
    step = int(target.name.rsplit("-", 1)[-1]) if target.name.startswith("step-") else None
    if step is None or not target.is_dir():
        raise CheckpointError(f"{target} is not a checkpoint (checkpoints/step-NNNNNN)")
    try:
        return run_dir, verified(target, step)
    except DamagedFile as exc:
        raise CheckpointError(f"the checkpoint of step {step} is damaged: {exc}; serve another (or the run "
                              f"directory, for its newest intact one)") from None


class ServedAgents:
    def __init__(self, target: str | Path, overrides: Sequence[str] = ()) -> None:
        self.run_dir, self.point = served_checkpoint(target)
        self.cfg: ExperimentConfig = load_config(self.run_dir / "config.toml", list(overrides))
        self.units = bases.engine_units(self.cfg)
        self.models = {a: self._model_dir(a) for a in self.cfg.agents}  # an adapter's carries the tokenizer
        for agent, path in self.models.items():
            if not has_tokenizer(path):
                raise CheckpointError(f"{path} holds no model with a tokenizer for agent {agent}")
        self.cfg.openai = dataclasses.replace(self.cfg.openai, enabled=True)
        self.server = ControllerServer(self.cfg.transport)
        self.instances = RolloutInstances(self.units)
        self.client = RolloutClient(self.server, self.instances, within_agent=self.cfg.router.within_agent,
                                    coalesce_tokens=self.cfg.router.coalesce_tokens,
                                    version_of=lambda agent: self.point.step)
        self.tokenizers: dict[str, AgentTokenizer] = {}
        self.endpoint = OpenAIEndpoint(self.cfg.openai, self.models, {a: c.tool_parser for a, c in self.cfg.agents.items()},
                                       serving=self.session)
        self.contexts = EpisodeContexts(self.cfg, self.client, None, self.tokenizers, self.endpoint)
        self._calls = itertools.count()

    def _model_dir(self, agent: str) -> str:
        """Where the served agent's weights are: its checkpoint's directory; a frozen agent's
        own model or adapter (a checkpoint names it, never copies it); a snapshot's source's
        checkpoint."""
        c = self.cfg.agents[agent]
        if c.snapshot_of:
            return str(self.point.agent_dir(c.snapshot_of))
        if not c.train:
            return c.adapter if c.adapter else resolve_model(c.model)
        return str(self.point.agent_dir(agent))

    def _checksums(self, agent: str) -> dict[str, str]:
        """The checkpoint's digests of what is loaded for `agent` (none for a frozen agent's
        own files, which no checkpoint holds)."""
        c = self.cfg.agents[agent]
        return self.point.agent_checksums(c.snapshot_of or agent) if c.train or c.snapshot_of else {}

    def session(self) -> Any:
        """One call's context: a store of its own that nothing trains from."""
        ctx = self.contexts.make(f"serve{next(self._calls)}", 0, random.Random(), ExperienceStore(list(self.cfg.agents)),
                                 None, trains=False)
        return OpenAITurns(ctx, self.endpoint, self.endpoint.key)

    async def run(self) -> None:
        async with StallWatch("serve").watching():
            await self._serve()

    async def _serve(self) -> None:
        address = self.server.bind()
        background = [asyncio.create_task(self.server.serve(), name="receive"),
                      asyncio.create_task(self.server.heartbeat(), name="heartbeat")]
        workers = LocalWorkers(address, self.run_dir / "serve-logs", curve_dir=self.cfg.transport.curve_dir,
                               threads=self.cfg.cluster.threads_per_worker)
        try:
            names = {unit: f"serve-{i}" for i, unit in enumerate(self.units)}
            for worker in names.values():
                workers.start("rollout", worker, None)
            await self.server.wait_for_workers({"rollout": len(names), "trainer": 0},
                                               self.cfg.cluster.worker_start_timeout_s)
            await asyncio.gather(*(self._load(unit, worker) for unit, worker in names.items()))
            url = await self.endpoint.start()
            assert self.endpoint.task is not None  # start() made it
            print(f"serving {', '.join(self.models)} (step {self.point.step} of {self.run_dir}) at {url}", flush=True)
            await supervise([self.endpoint.task], watch=background, forever=True)
        finally:
            await self._shut_down(workers, background)

    async def _load(self, unit: str, worker: str) -> None:
        """`worker`'s engine on `unit` at the checkpoint: a whole model's weights, or a base
        and then each of its agents' adapters."""
        u, step = self.units[unit], self.point.step
        for agent in u.agents:
            self.tokenizers[agent] = await asyncio.to_thread(AgentTokenizer, agent, self.models[agent])
        if not u.lora:
            message = msgspec.structs.replace(  # the engine checks the files it reads against the manifest
                whole_model_message(self.cfg, unit, self.server.next_request_id(), self.models[unit], step),
                checksums=self._checksums(unit))
        else:
            message = u.load_message(self.server.next_request_id(), await asyncio.to_thread(self._base_path, unit),
                                     self.cfg.run.seed, step)
        await self.server.call(worker, message)
        self.instances.engine_started(worker, unit, step)
        for agent in u.agents:
            if u.lora:
                lora = self.units.lora(agent)
                assert lora is not None  # an agent of a base's unit is an adapter
                await self.server.call(worker, protocol.LoadAdapter(
                    self.server.next_request_id(), agent, step, self.models[agent], lora,
                    self._checksums(agent)))
                self.instances.loaded(worker, agent, step)
            self.instances.serve(worker, agent, "serves the checkpoint")

    def _base_path(self, unit: str) -> str:
        """The base of a unit of adapters: the run's kept copy, else its model (an older
        run's, built or found in the model cache)."""
        base = self.cfg.agents[self.units[unit].agents[0]].base
        kept = kept_base(self.run_dir, base)
        return str(kept) if kept is not None else resolve_model(self.cfg.bases[base].model)

    async def _shut_down(self, workers: LocalWorkers, background: list[asyncio.Task]) -> None:
        timeout = self.cfg.cluster.shutdown_timeout_s
        await self.endpoint.stop()
        await self.server.shut_down_workers("serving ended", timeout)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        self.server.close()
        await asyncio.to_thread(workers.stop, timeout, min(5.0, timeout))
