"""The workflow API: a multi-agent episode is a user-written async function.

    async def episode(ctx: EpisodeContext) -> None:
        plans = await ctx.generate("planner", prompt_ids, n=4)
        for plan in plans:
            ctx.reward(plan, score(plan.output_ids))
        ...

`ctx.generate` opens one group in the experience store (n samples of one prompt), sends
the requests through the rollout client and returns the samples with their outputs.
Concurrency inside an episode (branches) and across episodes is plain asyncio; the
episode runner bounds it. `ctx.env` stands in for a slow tool or environment call.

If an episode raises or overruns its timeout, every group it opened that is not yet
trainable is dropped with the reason, counted, and logged; the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import zlib
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

from flexmarl.runtime import protocol

from .store import ExperienceStore, Sample

log = logging.getLogger("flexmarl.workflow")


class Generator(Protocol):
    async def generate(self, agent: str, requests: list[protocol.GenRequest]) -> list[protocol.GenResult]: ...


@dataclass
class AgentDefaults:
    max_tokens: int
    temperature: float
    group_size: int


def request_seed(run_seed: int, sample_id: str) -> int:
    """Deterministic per-sample sampling seed: the same sample id draws the same tokens
    under the same weights, whatever the batch it lands in (sync and async agree)."""
    return zlib.crc32(f"{run_seed}:{sample_id}".encode()) & 0x7FFFFFFF


@dataclass
class EpisodeContext:
    episode_id: str
    batch: int  # the global batch this episode belongs to
    rng: random.Random
    store: ExperienceStore
    generator: Generator
    agents: dict[str, AgentDefaults]
    run_seed: int
    env_latency_ms: float = 0.0
    # Awaited before every turn: blocks until the agent's rollout weights are recent
    # enough for this global batch (the staleness bound, checked per turn).
    gate: Callable[[str, int], Awaitable[None]] | None = None
    groups: list[str] = field(default_factory=list)
    _next_group: int = 0

    async def generate(self, agent: str, prompt_ids: list[int], n: int | None = None,
                       max_tokens: int | None = None, temperature: float | None = None) -> list[Sample]:
        if agent not in self.agents:
            raise KeyError(f"workflow asked for agent {agent!r}, which is not configured "
                           f"(agents: {', '.join(self.agents)})")
        defaults = self.agents[agent]
        if self.gate is not None:
            await self.gate(agent, self.batch)
        group_id = f"{self.episode_id}/{agent}{self._next_group}"
        self._next_group += 1
        samples = self.store.open_group(agent, group_id, prompt_ids, n or defaults.group_size, self.batch)
        self.groups.append(group_id)
        requests = [protocol.GenRequest(s.sample_id, s.prompt_ids, max_tokens or defaults.max_tokens,
                                        defaults.temperature if temperature is None else temperature,
                                        request_seed(self.run_seed, s.sample_id)) for s in samples]
        results = await self.generator.generate(agent, requests)
        by_id = {r.sample_id: r for r in results}
        for s in samples:
            r = by_id[s.sample_id]
            self.store.record_output(s.sample_id, r.token_ids, r.logprobs, [r.version])
        return samples

    def reward(self, sample: Sample, value: float) -> None:
        self.store.set_reward(sample.sample_id, value)

    async def env(self, mean_ms: float | None = None) -> None:
        """A simulated tool/environment call: exponentially distributed latency."""
        mean = self.env_latency_ms if mean_ms is None else mean_ms
        if mean > 0:
            await asyncio.sleep(self.rng.expovariate(1000.0 / mean))


Episode = Callable[[EpisodeContext], Awaitable[None]]


async def run_episode(episode: Episode, ctx: EpisodeContext, timeout_s: float) -> str:
    """Runs one episode; returns "" on success or the reason it failed (groups dropped)."""
    try:
        await asyncio.wait_for(episode(ctx), timeout_s)
        unfinished = [g for g in ctx.groups if ctx.store.groups[g].status == "pending"]
        if unfinished:
            raise RuntimeError(f"episode ended without rewarding every sample of {unfinished[:3]}")
        return ""
    except asyncio.TimeoutError:
        why = f"episode {ctx.episode_id} timed out after {timeout_s:.0f}s"
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a user's reward function or workflow bug: drop, count, go on
        why = f"episode {ctx.episode_id} failed: {type(exc).__name__}: {exc}"
    log.warning("%s; dropping its unfinished groups", why)
    for group_id in ctx.groups:
        ctx.store.drop_group(group_id, why)
    return why
