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

If an episode raises or overruns its timeout, it is closed: its other branches still
running are cancelled, any later `generate` in it raises `EpisodeClosed`, and every group
it opened that is not yet trainable is dropped with the reason, counted and logged; the
run goes on.

Group ids (and with them the per-sample sampling seeds) follow from the episode, the
agent, the prompt and how many identical calls came before in the episode, never from
which branch happens to finish first, so the same episode draws the same tokens in sync
and async mode, with any latency and any number of instances.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import zlib
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from flexmarl.runtime import protocol

from .store import ExperienceStore, Sample

log = logging.getLogger("flexmarl.workflow")


class EpisodeClosed(Exception):
    """The episode already failed; its remaining branches may not generate."""


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
    item: Any = None  # the episode's dataset row (None without a dataset)
    tools: Executor | None = None  # the bounded pool `call` runs blocking functions in
    tool_timeout_s: float = 60.0
    # Evaluation: one greedy (or eval.temperature) sample per call, never trained.
    eval_temperature: float | None = None
    groups: list[str] = field(default_factory=list)
    closed: str = ""  # why the episode failed, once it has
    _calls: Counter = field(default_factory=Counter)  # (agent, prompt) -> calls so far
    _branches: set = field(default_factory=set)  # tasks that called generate

    def group_id(self, agent: str, prompt_ids: list[int]) -> str:
        """The next group's id: the same call in the same place of the workflow gets the
        same id in every run, whatever the timing."""
        key = (agent, zlib.crc32(repr(list(prompt_ids)).encode()))
        occurrence = self._calls[key]
        self._calls[key] += 1
        return f"{self.episode_id}/{agent}-{key[1]:08x}-{occurrence}"

    async def generate(self, agent: str, prompt_ids: list[int], n: int | None = None,
                       max_tokens: int | None = None, temperature: float | None = None) -> list[Sample]:
        if self.closed:
            raise EpisodeClosed(self.closed)
        if agent not in self.agents:
            raise KeyError(f"workflow asked for agent {agent!r}, which is not configured "
                           f"(agents: {', '.join(self.agents)})")
        defaults = self.agents[agent]
        n = defaults.group_size if n is None else n
        if self.eval_temperature is not None:
            n, temperature = 1, self.eval_temperature
        elif n < 2:
            raise ValueError(f"generate({agent!r}, n={n}): a group needs at least 2 samples, since "
                             f"advantages are rewards relative to the group's other samples")
        task = asyncio.current_task()
        if task is not None:
            self._branches.add(task)
        if self.gate is not None:
            await self.gate(agent, self.batch)
        if self.closed:  # failed while this branch waited at the gate
            raise EpisodeClosed(self.closed)
        group_id = self.group_id(agent, prompt_ids)
        samples = self.store.open_group(agent, group_id, prompt_ids, n, self.batch)
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

    async def close(self, why: str) -> None:
        """Fails the episode: cancels its other branches and drops every group it opened
        that is not yet trainable (including ones a branch opened after the failure)."""
        self.closed = why
        me = asyncio.current_task()
        branches = [t for t in self._branches if t is not me and not t.done()]
        for task in branches:
            task.cancel()
        await asyncio.gather(*branches, return_exceptions=True)
        for group_id in self.groups:
            self.store.drop_group(group_id, why)

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Runs a tool, environment or reward function off the event loop and returns its
        result. A plain (blocking) function runs in the controller's bounded tool pool
        (`pipeline.tool_threads` threads); an async one is awaited. Past `timeout` seconds
        (default `pipeline.tool_timeout_s`) it raises TimeoutError, which fails this
        episode only: other episodes never wait for it. (A thread cannot be stopped: a
        timed-out blocking call keeps its pool thread until it returns.)"""
        if self.closed:
            raise EpisodeClosed(self.closed)
        limit = self.tool_timeout_s if timeout is None else timeout
        if asyncio.iscoroutinefunction(fn):
            work = fn(*args, **kwargs)
        else:
            loop = asyncio.get_running_loop()
            work = loop.run_in_executor(self.tools, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(work, limit)
        except asyncio.TimeoutError:
            name = getattr(fn, "__qualname__", repr(fn))
            raise TimeoutError(f"{name} did not return within {limit:.1f}s") from None

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
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            await episode(ctx)
        unfinished = [g for g in ctx.groups if ctx.store.groups[g].status == "pending"]
        if unfinished:
            raise RuntimeError(f"episode ended without rewarding every sample of {unfinished[:3]}")
        return ""
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a user's reward function or workflow bug: drop, count, go on
        if isinstance(exc, TimeoutError) and deadline.expired():
            why = f"episode {ctx.episode_id} timed out after {timeout_s:.0f}s"
        else:  # a tool's own timeout (ctx.call) is the episode's failure, not its deadline
            why = f"episode {ctx.episode_id} failed: {type(exc).__name__}: {exc}"
    log.warning("%s; dropping its unfinished groups", why)
    await ctx.close(why)
    return why
