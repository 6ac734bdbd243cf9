"""The experience store: per-agent tables of samples, grouped for GRPO, consumed once.

A group is the `n` samples one agent produced for one prompt. Samples arrive from the
rollout side (tokens, the sampler's logprobs, the policy version of every turn), rewards
arrive from the workflow, and a group becomes *trainable* only when every member has both;
then its group-normalised advantages are fixed. Trainable groups queue per agent in
arrival order; `take` hands out whole groups' samples and marks them consumed, so a sample
can be trained at most once, and a duplicate or late result for a sample that already has
its output is refused.

Plain synchronous Python: no sockets, no asyncio, no knowledge of workers.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Iterable

PENDING, READY, CONSUMED, DROPPED = "pending", "ready", "consumed", "dropped"


class DuplicateResult(Exception):
    """A result arrived for a sample that already has one (a retried request, say)."""


@dataclass
class Sample:
    sample_id: str
    agent: str
    group_id: str
    prompt_ids: list[int]
    output_ids: list[int] | None = None
    logprobs: list[float] | None = None
    versions: list[int] = field(default_factory=list)  # policy version of every turn
    reward: float | None = None
    advantage: float | None = None
    status: str = PENDING
    tag: int = 0  # which global batch (iteration) started it

    @property
    def min_version(self) -> int:
        return min(self.versions)


@dataclass
class Group:
    group_id: str
    agent: str
    sample_ids: list[str]
    tag: int
    status: str = PENDING
    why_dropped: str = ""


class ExperienceStore:
    def __init__(self, agents: Iterable[str]) -> None:
        self.samples: dict[str, Sample] = {}
        self.groups: dict[str, Group] = {}
        self.ready: dict[str, collections.deque[str]] = {a: collections.deque() for a in agents}
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()  # (agent, status)

    # ---------------------------------------------------------------- rollout side

    def open_group(self, agent: str, group_id: str, prompt_ids: list[int], n: int, tag: int) -> list[Sample]:
        if agent not in self.ready:
            raise KeyError(f"unknown agent {agent!r} (configured: {', '.join(self.ready)})")
        if group_id in self.groups:
            raise DuplicateResult(f"group {group_id} already exists")
        members = [Sample(f"{group_id}/{i}", agent, group_id, list(prompt_ids), tag=tag) for i in range(n)]
        for s in members:
            self.samples[s.sample_id] = s
        self.groups[group_id] = Group(group_id, agent, [s.sample_id for s in members], tag)
        self.counts[(agent, "generated")] += n
        return members

    def record_output(self, sample_id: str, output_ids: list[int], logprobs: list[float],
                      versions: list[int]) -> Sample:
        sample = self.samples.get(sample_id)
        if sample is None:
            raise KeyError(f"unknown sample {sample_id}")
        if sample.output_ids is not None or sample.status != PENDING:
            raise DuplicateResult(f"sample {sample_id} already has an output ({sample.status})")
        sample.output_ids = list(output_ids)
        sample.logprobs = list(logprobs)
        sample.versions = list(versions)
        return sample

    def set_reward(self, sample_id: str, reward: float) -> None:
        sample = self.samples[sample_id]
        if sample.status != PENDING:
            return  # its group was dropped meanwhile
        if not math.isfinite(reward):
            raise ValueError(f"reward for {sample_id} is not finite: {reward}")
        sample.reward = float(reward)
        self._maybe_ready(self.groups[sample.group_id])

    def drop_group(self, group_id: str, why: str) -> None:
        group = self.groups[group_id]
        if group.status != PENDING:
            return
        group.status = DROPPED
        group.why_dropped = why
        for sid in group.sample_ids:
            self.samples[sid].status = DROPPED
        self.counts[(group.agent, DROPPED)] += len(group.sample_ids)

    def _maybe_ready(self, group: Group) -> None:
        members = [self.samples[s] for s in group.sample_ids]
        if group.status != PENDING or any(s.output_ids is None or s.reward is None for s in members):
            return
        for s, adv in zip(members, group_advantages([s.reward for s in members])):
            s.advantage = adv
            s.status = READY
        group.status = READY
        self.ready[group.agent].append(group.group_id)

    # ---------------------------------------------------------------- training side

    def ready_samples(self, agent: str) -> int:
        return sum(len(self.groups[g].sample_ids) for g in self.ready[agent])

    def take(self, agent: str, max_samples: int) -> list[Sample]:
        """Whole ready groups, oldest first, up to `max_samples` (at least one group)."""
        taken: list[Sample] = []
        queue = self.ready[agent]
        while queue:
            group = self.groups[queue[0]]
            if taken and len(taken) + len(group.sample_ids) > max_samples:
                break
            queue.popleft()
            group.status = CONSUMED
            for sid in group.sample_ids:
                sample = self.samples[sid]
                assert sample.status == READY, f"{sid} is {sample.status}, not ready"
                sample.status = CONSUMED
                taken.append(sample)
            self.counts[(agent, CONSUMED)] += len(group.sample_ids)
        return taken

    def forget(self, samples: Iterable[Sample]) -> None:
        """Frees trained samples' token lists (the ids and counts stay)."""
        for s in samples:
            s.prompt_ids = s.output_ids = s.logprobs = []

    def pending_groups(self, agent: str | None = None) -> list[Group]:
        return [g for g in self.groups.values() if g.status == PENDING and (agent is None or g.agent == agent)]


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO: reward minus the group mean, over the group's standard deviation."""
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards]
