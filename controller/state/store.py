"""The experience store: per-agent groups of samples for GRPO, consumed once.

A group is the `n` samples one agent produced for one prompt, kept as one columnar record
(records.py: `GroupRecord`), keyed by its `GroupKey`. Outputs arrive from the rollout side
whole (`record_group`: tokens, the sampler's logprobs, the policy version of every token,
kept as the reply packed them), later turns one member at a time (`record_turn`), rewards
from the workflow; a group becomes *trainable* only when every member has both, and then
its group-normalised advantages and its size in tokens are fixed. Trainable groups queue
per agent and per global batch in arrival order; `form_micro_batches` cuts micro-batches
of whole groups by the pipeline's rules (decisions.py), dropping what is too stale, and
marks them consumed, so a sample is trained at most once; a duplicate or late result for
a group that already has its outputs is refused.

The records are the store's alone: others ask it. User code sees a member through a
read-only `SampleView` and changes it through the episode context, which calls the store
(`record_turn`, `annotate`, `set_reward`); the pipeline gets `MicroBatch`es (what it sends,
logs and counts of their groups); the checkpoint asks what it must keep
(`samples_past`), the re-drive of a log what it refills (`record_versions`).

Plain synchronous Python: no sockets, no asyncio, no knowledge of workers.
"""

from __future__ import annotations

import array
import collections
import itertools
import logging
import math
from typing import Callable, Iterable, Sequence

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey

from ..control.interfaces import Emit
from . import decisions
from .groups import GroupOutput
from .records import (CONSUMED, DROPPED, PENDING, READY, REWARD, SERVED, DuplicateResult, GroupRecord, SampleView,
                      TurnSampling)

log = logging.getLogger("flexmarl.store")

__all__ = ["CONSUMED", "DROPPED", "PENDING", "READY", "SERVED", "DuplicateResult", "ExperienceStore", "MicroBatch",
           "SampleView", "TurnSampling", "group_advantages"]


class MicroBatch:
    """Whole trainable groups the pipeline sends to a trainer together: what it sends
    (`wire`), logs (`parts`, `oldest`) and counts of them; the store forgets them. Read-only."""

    __slots__ = ("_groups", "samples")

    def __init__(self, groups: tuple[GroupRecord, ...]) -> None:
        self._groups = groups
        self.samples = sum(g.n for g in groups)

    @property
    def ready_first(self) -> int:
        """When the first of its groups became trainable (across every agent)."""
        return min((g.ready_seq for g in self._groups), default=0)

    def parts(self) -> ev.Parts:
        return ev.whole([(g.key, g.n) for g in self._groups])

    def keys(self) -> list[GroupKey]:
        return [g.key for g in self._groups]

    def oldest(self) -> list[int]:
        """Per sample, in order: the oldest policy version of any of its turns."""
        return [v for g in self._groups for v in g.oldest()]

    def rewards(self) -> list[float]:
        return [r for g in self._groups for r in g.rewards_list()]

    def wire(self) -> list[protocol.TrainGroup]:
        return [g.train_group() for g in self._groups]


class ExperienceStore:
    def __init__(self, agents: Iterable[str], emit: Emit | None = None,
                 std_normalized: dict[str, bool] | None = None, frozen: Iterable[str] = (),
                 dynamic: Iterable[str] = (), teachers: dict[str, str] | None = None,
                 assigned_at_end: bool = False) -> None:
        self.emit = emit or (lambda event: None)  # the event log (every transition is recorded)
        # Per agent: advantages divided by the group's std (GRPO) or not (Dr. GRPO).
        self._by_std = std_normalized or {}
        # Agents that are served, never trained: their groups never become trainable; the
        # episode serves them when it ends (`serve_groups`); told the key of each served.
        self.frozen = frozenset(frozen)
        self.on_served: list[Callable[[GroupKey], None]] = []
        # Distilled agent -> its teacher: a group of it is trainable once scored too (`record_teacher`).
        self._teachers = dict(teachers or {})
        # Dynamic sampling (decisions.dynamic_drop): per (agent, batch) the groups opened and
        # kept, and the batch's target once its regular episodes ended (`set_target`).
        self.dynamic = frozenset(dynamic)
        self._opened_of: collections.Counter[tuple[str, int]] = collections.Counter()
        self._kept: collections.Counter[tuple[str, int]] = collections.Counter()
        self._targets: dict[tuple[str, int], int] = {}
        self._dynamic_drops: collections.Counter[tuple[str, int, str]] = collections.Counter()  # (agent, batch, why) -> groups
        self._groups: dict[GroupKey, GroupRecord] = {}
        # Continuous admission: a group's batch is its episode's, named when the episode ends
        # (`assign`); until then a trainable one is held here, in no batch's queue.
        self.assigned_at_end = assigned_at_end
        self._unassigned: set[GroupKey] = set()
        self._held: dict[GroupKey, GroupRecord] = {}
        self._ready: dict[str, dict[int, collections.deque[GroupRecord]]] = {a: {} for a in agents}
        # Told the key of each group that becomes trainable, as it does.
        self.on_ready: list[Callable[[GroupKey], None]] = []
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()  # (agent, status)
        self._ready_seq = itertools.count(1)
        self._ready_count: collections.Counter[tuple[str, int]] = collections.Counter()  # (agent, batch) -> samples in ready
        self._waiting: collections.Counter[str] = collections.Counter()  # agent -> samples in ready, every batch

    # ---------------------------------------------------------------- rollout side

    def open_group(self, key: GroupKey, prompt_ids: Sequence[int], n: int, batch: int) -> None:
        agent = key.agent
        if agent not in self._ready:
            raise KeyError(f"unknown agent {agent!r} (configured: {', '.join(self._ready)})")
        if key in self._groups:
            raise DuplicateResult(f"group {key} already exists")
        self.emit(ev.GroupOpened(key, batch, n))
        self._opened_of[(agent, batch)] += 1
        self._groups[key] = GroupRecord.opened(key, prompt_ids, n, batch)
        if self.assigned_at_end:
            self._unassigned.add(key)
        self._counts[(agent, "generated")] += n

    def record_group(self, key: GroupKey, output: GroupOutput, sampling: TurnSampling) -> None:
        """Every member's first turn at once, sampled from `sampling`'s distribution."""
        group = self._group(key)
        if group.status != PENDING:
            raise DuplicateResult(f"group {key} already has its outputs ({group.status})")
        group.record_outputs(output, sampling)

    def record_versions(self, key: GroupKey, first: int, size: int, version: int,
                        oldest: Sequence[int] = ()) -> None:
        """Members `first` to `first + size - 1` of the group, those without an output yet,
        get an empty one from `version`: a re-drive from the event log, where a completed
        part of a group is its members and the version that generated them (and, where
        their tokens spanned versions, `oldest`: per member the oldest, UNSPANNED where not)."""
        self._groups[key].record_versions(first, size, version, oldest)

    def turn_context(self, key: GroupKey, member: int, appended_ids: Sequence[int]) -> tuple[list[int], str, int]:
        """For another turn of member `member`: the ids to generate it from (its prompt,
        its output so far, `appended_ids`), the instance of its last turn, and the turn's
        number. Raises ValueError if it cannot take one."""
        group = self._group(key)
        if not group.has_output(member):  # its group is still generating its first turn
            raise ValueError(f"sample {key.sample(member)} cannot take another turn: its first turn has not "
                             f"returned yet")
        self._check_turn(group, member)
        return group.context(member, appended_ids), group.served_by[member], len(group.turn_versions(member))

    def record_turn(self, key: GroupKey, member: int, appended_ids: Sequence[int], output: GroupOutput,
                    sampling: TurnSampling | None = None) -> None:
        """A later turn of a conversation: `appended_ids` (not trained) then the turn's
        generated ids (trained, `output` a group of one), with `sampling`'s settings."""
        group = self._group(key)
        if not group.has_output(member):
            raise ValueError(f"sample {key.sample(member)} cannot take another turn: it has no first turn")
        self._check_turn(group, member)
        group.record_turn(member, appended_ids, output, sampling or TurnSampling(0))

    @staticmethod
    def _check_turn(group: GroupRecord, member: int) -> None:
        reward = group.reward(member)
        if group.status != PENDING or reward is not None:
            raise ValueError(f"sample {group.key.sample(member)} cannot take another turn: it is {group.status}"
                             + (" and already rewarded" if reward is not None else ""))

    def annotate(self, key: GroupKey, member: int, text: str, messages: list | None) -> None:
        """The last turn's text and the conversation so far, as the episode context made them."""
        self._group(key).annotate(member, text, messages)

    def view(self, key: GroupKey, member: int) -> SampleView:
        return SampleView(self._group(key), member)

    def views(self, key: GroupKey) -> list[SampleView]:
        """The group's members, in order."""
        group = self._group(key)
        return [SampleView(group, j) for j in range(group.n)]

    def agent_views(self, keys: Iterable[GroupKey], agent: str) -> list[SampleView]:
        """The members of those of `keys`' groups the store holds that are `agent`'s."""
        groups = self._groups
        return [SampleView(g, j) for key in keys if key.agent == agent and (g := groups.get(key)) is not None
                for j in range(g.n)]

    def kept_views(self, agent: str) -> list[SampleView]:
        """Every sample of `agent` the store holds and did not drop."""
        return [SampleView(g, j) for g in self._groups.values() if g.agent == agent and g.status != DROPPED
                for j in range(g.n)]

    def pending(self, keys: Iterable[GroupKey]) -> list[GroupKey]:
        """Those of `keys` whose groups are not trainable yet (nor dropped, nor served)."""
        groups = self._groups
        return [k for k in keys if k in groups and groups[k].status == PENDING]

    # ---------------------------------------------------------------- teachers and frozen agents

    def teacher_of(self, agent: str) -> str:
        """The agent whose logprobs a distilled `agent` is trained towards ("": none)."""
        return self._teachers.get(agent, "")

    def to_score(self, keys: Iterable[GroupKey]) -> list[GroupKey]:
        """Those of `keys` whose groups wait for their teacher's scores (a distilled agent's, pending)."""
        groups, teachers = self._groups, self._teachers
        return [k for k in keys if k.agent in teachers and k in groups and groups[k].status == PENDING
                and groups[k].teacher_logprobs is None]

    def sequences(self, key: GroupKey) -> list[tuple[list[int], int]]:
        """Per member, what a teacher scores: its prompt and output ids, and where its output begins."""
        group = self._group(key)
        return [group.sequence(j) for j in range(group.n)]

    def record_teacher(self, key: GroupKey, logprobs: Sequence[Sequence[float]], versions: list[int],
                       top: Sequence[tuple[bytes, bytes]] | None = None, top_k: int = 0) -> None:
        """A distilled agent's group scored by its teacher: member j's teacher logprobs (one
        per output id) from the teacher's policy version `versions[j]`, and with `top` its
        packed top-`top_k` ids and logprobs at each output position; the group becomes
        trainable now if every member has its reward."""
        group = self._group(key)
        if group.status != PENDING:
            return  # dropped meanwhile (its episode failed)
        group.record_teacher(logprobs, top, top_k)
        self.emit(ev.TeacherScored(key, group.batch, self._teachers.get(group.agent, ""), list(versions)))
        if group.rewarded == group.n:
            self._maybe_ready(group)

    def serve_groups(self, keys: Iterable[GroupKey]) -> None:
        """Those of `keys` that are a frozen agent's groups, their episode ended: generated,
        never to be trained (their rewards, if the workflow gave any, recorded with them);
        then let go."""
        for key in keys:
            group = self._groups.get(key)
            if group is None or group.agent not in self.frozen or group.status != PENDING or not group.has_outputs():
                continue
            self.emit(ev.GroupServed(key, group.n, [r for r in group.rewards_list() if r == r]))
            group.status = SERVED
            self._counts[(group.agent, SERVED)] += group.n
            for listener in self.on_served:
                listener(key)
            del self._groups[key]

    def set_reward(self, key: GroupKey, member: int, reward: float) -> None:
        self._reward(self._group(key), member, reward)

    def set_view_reward(self, sample: SampleView, reward: float) -> None:
        """`set_reward` of the sample a view shows (its record at hand: no lookup by key
        where the store still holds it)."""
        record = sample._record
        if self._groups.get(record.key) is not record:
            record = self._group(record.key)  # let go (or never the store's): as set_reward says
        self._reward(record, sample.member, reward)

    def set_group_rewards(self, key: GroupKey, rewards: Sequence[float], size: int | None = None) -> None:
        """The rewards of the group's members, in order (as many as given): what
        `set_reward` of each in turn does, in one call. `size`: the group's size in tokens
        as the event log counted it, where the outputs are not kept (a re-drive)."""
        group = self._group(key)
        if size is not None:
            group.size = size
        for member, reward in enumerate(rewards):
            self._reward(group, member, reward)

    def _reward(self, group: GroupRecord, member: int, reward: float) -> None:
        """Sets a pending sample's reward (nothing if its group was dropped); the group's
        last one makes it trainable if it can be."""
        if group.status == DROPPED:
            return  # its group was dropped meanwhile (its episode failed)
        if group.status != PENDING:
            raise ValueError(f"reward for {group.key.sample(member)} arrived after its group was complete "
                             f"({group.status}): its advantages are already fixed, so this reward would be "
                             f"ignored. Set every sample's reward before the last one of its group")
        if not math.isfinite(reward):
            raise ValueError(f"reward for {group.key.sample(member)} is not finite: {reward}")
        before = group.set_reward(member, float(reward))
        if before is not None:
            raise ValueError(f"reward for {group.key.sample(member)} set twice ({before} then {reward})")
        group.rewarded += 1
        if group.rewarded == group.n:
            self._maybe_ready(group)

    def drop_group(self, key: GroupKey, why: str) -> None:
        group = self._groups[key]
        if group.status != PENDING:
            return
        self.emit(ev.SamplesDropped(group.agent, ev.whole([(key, group.n)]), why))
        group.status = DROPPED
        self._counts[(group.agent, DROPPED)] += group.n

    def _maybe_ready(self, group: GroupRecord) -> None:
        if group.status != PENDING or not group.has_outputs():  # a member without its first turn
            return
        agent, batch = group.agent, group.batch
        if agent in self.frozen:  # a frozen agent's: served at its episode's end
            return
        if agent in self._teachers and group.teacher_logprobs is None and not group.size:
            return  # not scored by its teacher yet (a re-drive's groups keep no outputs to score)
        rewards = group.rewards_list()
        if not group.size:  # set beforehand only where the outputs are not kept (a re-drive)
            group.size = len(group.prompt) // 4 + group.output_size()
        self.emit(ev.GroupComplete(group.key, rewards, group.size))  # the event keeps the list
        if agent in self.dynamic:
            why = decisions.dynamic_drop(rewards, self._kept[(agent, batch)], self._targets.get((agent, batch)))
            if why:
                self._dynamic_drops[(agent, batch, why)] += 1
                self.drop_group(group.key, why)
                return
            self._kept[(agent, batch)] += 1
        advantages = group_advantages(rewards, by_std=self._by_std.get(agent, True))
        group.advantages = array.array(REWARD, advantages).tobytes()
        group.status, group.ready_seq = READY, next(self._ready_seq)
        group.settle()
        if group.key in self._unassigned:  # queued once its episode's batch is named
            self._held[group.key] = group
            return
        self._queue(group)

    def assign(self, keys: Iterable[GroupKey], batch: int) -> None:
        """Continuous admission: the groups of an episode that ended (those of `keys` the
        store holds) belong to global batch `batch`; the trainable ones join its queue."""
        for key in keys:
            group = self._groups.get(key)
            if group is None or key not in self._unassigned:
                continue
            self._unassigned.discard(key)
            group.batch = batch
            if self._held.pop(key, None) is not None:
                self._queue(group)

    def abandon(self, keys: Iterable[GroupKey], why: str) -> None:
        """Continuous admission: the episode that opened `keys` was abandoned (no batch can
        train it): those of its groups the store holds and no batch took are dropped,
        whether still generating or trainable and held."""
        for key in keys:
            group = self._groups.get(key)
            if group is None or key not in self._unassigned:
                continue
            self._unassigned.discard(key)
            if self._held.pop(key, None) is not None:
                group.status = PENDING  # trainable, never queued: dropped as any group not yet trained
            self.drop_group(key, why)

    def _queue(self, group: GroupRecord) -> None:
        agent, batch = group.agent, group.batch
        queues = self._ready[agent]
        queue = queues.get(batch)
        if queue is None:
            queues[batch] = queue = collections.deque()
        queue.append(group)
        self._ready_count[(agent, batch)] += group.n
        self._waiting[agent] += group.n
        for listener in self.on_ready:
            listener(group.key)

    def _group(self, key: GroupKey) -> GroupRecord:
        group = self._groups.get(key)
        if group is None:
            raise KeyError(f"unknown group {key}")
        return group

    # ---------------------------------------------------------------- dynamic sampling

    def groups_opened(self, agent: str, batch: int) -> int:
        return self._opened_of[(agent, batch)]

    def groups_kept(self, agent: str, batch: int) -> int:
        """A dynamic-sampling agent's groups of `batch` that became trainable."""
        return self._kept[(agent, batch)]

    def dynamic_dropped(self, agent: str, batch: int, why: str) -> int:
        """A dynamic-sampling agent's groups of `batch` dropped for `why` (decisions.EQUAL_REWARDS, SURPLUS)."""
        return self._dynamic_drops[(agent, batch, why)]

    def set_target(self, agent: str, batch: int, groups: int) -> None:
        """The groups `agent` trains in `batch` (its regular episodes'): more from extra
        episodes are surplus (`decisions.dynamic_drop`)."""
        self._targets[(agent, batch)] = groups

    # ---------------------------------------------------------------- training side

    def ready_samples(self, agent: str, batch: int) -> int:
        return self._ready_count[(agent, batch)]

    def waiting(self, agent: str) -> int:
        """The agent's trainable samples not yet taken, of every batch."""
        return self._waiting[agent]

    def ready_size(self, agent: str, batch: int, size: decisions.MicroBatchSize) -> int:
        """What is ready, in samples or tokens as `size` counts."""
        if not size.tokens:  # counted as groups become ready and are taken
            return self._ready_count[(agent, batch)]
        return sum(size.of_group(g.n, g.size) for g in self._ready[agent].get(batch, ()))

    def take(self, agent: str, batch: int, size: decisions.MicroBatchSize) -> list[GroupRecord]:
        """Whole ready groups of global batch `batch`, oldest first, up to `size`'s limit
        (at least one group if any is ready: a group is never split)."""
        queue = self._ready[agent].get(batch)
        if not queue:
            return []
        sizes = (size.of_group(g.n, g.size) for g in queue)  # read lazily: stops at the cut
        taken = [queue.popleft() for _ in range(decisions.groups_in_micro_batch(sizes, size.limit))]
        samples = 0
        for group in taken:
            assert group.status == READY, f"{group.key} is {group.status}, not ready"
            group.status = CONSUMED
            samples += group.n
        self._ready_count[(agent, batch)] -= samples
        self._waiting[agent] -= samples
        self._counts[(agent, CONSUMED)] += samples
        return taken

    def form_micro_batches(self, agent: str, batch: int, size: decisions.MicroBatchSize, complete: bool,
                           overlap: bool, max_staleness: int) -> list[MicroBatch]:
        """Takes every micro-batch the rules allow now for `agent`'s global batch `batch`,
        each of `size` (`decisions.cut_micro_batch`). A group with any turn older than the
        staleness bound is dropped here, never trained (`decisions.split_stale`)."""
        formed = []
        while decisions.cut_micro_batch(self.ready_size(agent, batch, size), size.limit, complete, overlap):
            kept, stale = decisions.split_stale(self.take(agent, batch, size), batch, max_staleness)
            if stale:
                log.error("dropping %d samples of %s older than the staleness bound %d", sum(g.n for g in stale),
                          agent, max_staleness)
                self._reject(agent, stale, f"lag above max_staleness={max_staleness}")
            if kept:
                formed.append(MicroBatch(tuple(kept)))
        return formed

    def _reject(self, agent: str, groups: list[GroupRecord], why: str) -> None:
        """Marks taken groups dropped instead of trained (found too stale)."""
        self.emit(ev.SamplesDropped(agent, ev.whole([(g.key, g.n) for g in groups]), why))
        samples = sum(g.n for g in groups)
        for group in groups:
            group.status = DROPPED
        self._counts[(agent, CONSUMED)] -= samples
        self._counts[(agent, DROPPED)] += samples

    def forget(self, micro_batch: MicroBatch) -> None:
        """Lets trained groups go: a long run's store holds what is in flight and not yet
        committed, not its history (the counts stay; the event log has the rest)."""
        groups = self._groups
        for key in micro_batch.keys():
            groups.pop(key, None)

    # ---------------------------------------------------------------- questions

    def holds(self, key: GroupKey) -> bool:
        return key in self._groups

    def count(self, agent: str, what: str) -> int:
        """How many of `agent`'s samples were "generated", "consumed", "dropped" or "served" so far."""
        return self._counts[(agent, what)]

    def samples_past(self, batch: int) -> collections.Counter[str]:
        """Per agent, the samples the store holds of batches after `batch` (what a
        checkpoint of `batch` does not keep)."""
        past: collections.Counter[str] = collections.Counter()
        for g in self._groups.values():
            if g.batch > batch:
                past[g.agent] += g.n
        return past


def group_advantages(rewards: list[float], eps: float = 1e-6, by_std: bool = True) -> list[float]:
    """GRPO: reward minus the group mean, over the group's standard deviation (by_std);
    without the division (Dr. GRPO) when by_std is False."""
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not by_std:
        return centred
    std = math.sqrt(sum([c ** 2 for c in centred]) / len(rewards))
    scale = std + eps
    return [c / scale for c in centred]
