"""The experience store: per-agent tables of samples, grouped for GRPO, consumed once.

A group is the `n` samples one agent produced for one prompt. Samples arrive from the
rollout side (tokens, the sampler's logprobs, the policy version of every turn), rewards
arrive from the workflow, and a group becomes *trainable* only when every member has both;
then its group-normalised advantages and its size in tokens are fixed. Trainable groups
queue per agent and per global batch in arrival order; `take` hands out whole groups'
samples (as many as `decisions.groups_in_micro_batch` says, in samples or in tokens) and
marks them consumed, so a sample can be trained at most once, and a duplicate or late
result for a sample that already has its output is refused. `form_micro_batches` cuts
micro-batches by the pipeline's rules (decisions.py), dropping what is too stale.

The records are the store's own: a group's outputs arrive whole (`record_group`), token
ids and logprobs held as packed arrays, not per-token Python objects. User code sees a
sample only through a read-only `SampleView` and changes it through the episode context,
which calls the store (`record_turn`, `annotate`, `set_reward`).

Plain synchronous Python: no sockets, no asyncio, no knowledge of workers.
"""

from __future__ import annotations

import array
import collections
import itertools
import logging
import math
from typing import Callable, Iterable, Sequence

import msgspec

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol

from ..control.interfaces import Emit
from . import decisions
from .groups import GroupOutput

log = logging.getLogger("flexmarl.store")

PENDING, READY, CONSUMED, DROPPED = "pending", "ready", "consumed", "dropped"
SERVED = "served"  # a frozen agent's: generated, never to be trained

# A first turn recorded without its settings (frozen: one value shared by every such sample).
DEFAULT_SAMPLING = protocol.TurnSampling(0)


class DuplicateResult(Exception):
    """A result arrived for a sample that already has one (a retried request, say)."""


def token_array(ids: Sequence[int]) -> array.array:
    return ids if type(ids) is array.array and ids.typecode == protocol.TOKEN_TYPECODE else \
        array.array(protocol.TOKEN_TYPECODE, ids)


def logprob_array(values: Sequence[float]) -> array.array:
    return values if type(values) is array.array and values.typecode == protocol.LOGPROB_TYPECODE else \
        array.array(protocol.LOGPROB_TYPECODE, values)


# No output: a sample's re-driven from the event log (which keeps versions, not tokens), or
# a trained one's let go. One empty array shared by all (never extended: neither kind of
# sample takes another turn).
NO_OUTPUT, NO_LOGPROBS, NO_MASK = token_array(()), logprob_array(()), array.array("b")


# The store's records are untracked by the collector (gc=False: plain data, no reference
# cycles): a large run holds hundreds of thousands, and every collection would walk them.
class Sample(msgspec.Struct, gc=False):
    sample_id: str
    agent: str
    group_id: str
    prompt_ids: list[int]
    # Everything after the prompt, in order: every turn's generated ids and, in a
    # conversation, the ids appended between turns (other agents' messages, tool results).
    output_ids: array.array | None = None
    logprobs: array.array | None = None  # per output id; 0.0 for appended ids
    # Until its output arrives a sample has none of these (immutable placeholders: a group
    # opened is n small records, nothing more).
    versions: list[int] = ()  # type: ignore[assignment]  # () until set; policy version of every turn
    mask: array.array | None = None  # per output id: 1 generated (trained), 0 appended
    # What every turn was sampled at (temperature, top_p, top_k, from which output id on):
    # the trainer scores each turn's tokens under its own distribution.
    sampling: list[protocol.TurnSampling] = ()  # type: ignore[assignment]  # () until set
    text: str = ""  # the last turn's generated text (agents with a tokenizer)
    messages: list | None = None  # the conversation so far, for samples made by ctx.chat
    reward: float | None = None
    advantage: float | None = None
    status: str = PENDING
    batch: int = 0  # which global batch (iteration) started it
    ready_seq: int = 0  # the order in which its group became trainable, across every agent
    served_by: str = ""  # the instance that generated its last turn (its prefix cache has it)
    finish_reason: str = ""  # why its last turn ended
    # On-policy distillation: its teacher's logprob of each output id, once scored.
    teacher_logprobs: array.array | None = None

    @property
    def min_version(self) -> int:
        return min(self.versions)


class SampleView(msgspec.Struct, frozen=True, gc=False):
    """A sample as user code sees it: read-only, always current (a later turn shows
    through). Lists it returns are copies; change a sample through the episode context."""

    _s: Sample

    sample_id = property(lambda self: self._s.sample_id)
    agent = property(lambda self: self._s.agent)
    group_id = property(lambda self: self._s.group_id)
    text = property(lambda self: self._s.text, doc="the last turn's generated text (agents with a tokenizer)")
    reward = property(lambda self: self._s.reward)
    status = property(lambda self: self._s.status, doc="pending until its group is ready, consumed or dropped")
    finish_reason = property(lambda self: self._s.finish_reason)
    prompt_ids = property(lambda self: list(self._s.prompt_ids))
    output_ids = property(lambda self: None if self._s.output_ids is None else self._s.output_ids.tolist(),
                          doc="every turn's generated ids and the ids appended between turns, in order")
    logprobs = property(lambda self: None if self._s.logprobs is None else self._s.logprobs.tolist())
    mask = property(lambda self: None if self._s.mask is None else self._s.mask.tolist(),
                    doc="per output id: 1 generated, 0 appended")
    versions = property(lambda self: list(self._s.versions), doc="the policy version of every turn")
    messages = property(lambda self: None if self._s.messages is None else [dict(m) for m in self._s.messages],
                        doc="the conversation so far (samples made by ctx.chat)")

    def __repr__(self) -> str:
        return f"SampleView({self._s.sample_id!r}, text={self._s.text!r}, reward={self._s.reward})"


class Group(msgspec.Struct, gc=False):
    group_id: str
    agent: str
    sample_ids: list[str]
    batch: int
    status: str = PENDING
    rewarded: int = 0  # members whose reward is set
    tokens: int = 0  # once trainable: its prompt once plus every output (what a token budget counts)
    # The records of `sample_ids`, in order (the same ones `ExperienceStore.samples` holds):
    # what the store does to a whole group reaches them without looking each one up.
    members: list[Sample] = []


class ExperienceStore:
    def __init__(self, agents: Iterable[str], emit: Emit | None = None,
                 std_normalized: dict[str, bool] | None = None, frozen: Iterable[str] = (),
                 dynamic: Iterable[str] = (), teachers: dict[str, str] | None = None) -> None:
        self.emit = emit or (lambda event: None)  # the event log (every transition is recorded)
        # Per agent: advantages divided by the group's std (GRPO) or not (Dr. GRPO).
        self.std_normalized = std_normalized or {}
        # Agents that are served, never trained: their groups never become trainable; the
        # episode serves them when it ends (`serve_group`).
        self.frozen = frozenset(frozen)
        # Distilled agent -> its teacher: a group of it is trainable once scored too (`record_teacher`).
        self.teachers = dict(teachers or {})
        self.on_served: list[Callable[[Group], None]] = []
        # Dynamic sampling (decisions.dynamic_drop): per (agent, batch) the groups opened and
        # kept, and the batch's target once its regular episodes ended (`set_target`).
        self.dynamic = frozenset(dynamic)
        self._opened: collections.Counter[tuple[str, int]] = collections.Counter()
        self._kept: collections.Counter[tuple[str, int]] = collections.Counter()
        self._targets: dict[tuple[str, int], int] = {}
        self.dynamic_drops: collections.Counter[tuple[str, int, str]] = collections.Counter()  # (agent, batch, why) -> groups
        self.samples: dict[str, Sample] = {}
        self.groups: dict[str, Group] = {}
        self.ready: dict[str, dict[int, collections.deque[str]]] = {a: {} for a in agents}
        self.on_ready: list[Callable[[Group], None]] = []
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()  # (agent, status)
        self._ready_seq = itertools.count(1)
        self._ready_count: collections.Counter[tuple[str, int]] = collections.Counter()  # (agent, batch) -> samples in ready

    # ---------------------------------------------------------------- rollout side

    def open_group(self, agent: str, group_id: str, prompt_ids: list[int], n: int, batch: int) -> list[Sample]:
        if agent not in self.ready:
            raise KeyError(f"unknown agent {agent!r} (configured: {', '.join(self.ready)})")
        if group_id in self.groups:
            raise DuplicateResult(f"group {group_id} already exists")
        prompt = list(prompt_ids)  # one list for the whole group: members never modify it
        sample_ids = [f"{group_id}/{i}" for i in range(n)]
        members = [Sample(sid, agent, group_id, prompt, batch=batch) for sid in sample_ids]
        self.emit(ev.GroupOpened(agent, group_id, [], batch, n))
        self._opened[(agent, batch)] += 1
        self.samples.update(zip(sample_ids, members))
        self.groups[group_id] = Group(group_id, agent, sample_ids, batch, members=members)
        self.counts[(agent, "generated")] += n
        return members

    def record_output(self, sample_id: str, output_ids: Sequence[int], logprobs: Sequence[float],
                      versions: list[int], sampling: protocol.TurnSampling | None = None) -> Sample:
        sample = self.samples.get(sample_id)
        if sample is None:
            raise KeyError(f"unknown sample {sample_id}")
        self._record_first_turn(sample, output_ids, logprobs, versions, sampling)
        return sample

    def record_versions(self, group_id: str, first: int, size: int, version: int) -> None:
        """Members `first` to `first + size - 1` of the group, those without an output yet,
        get `NO_OUTPUT` from `version`: a re-drive from the event log, where a completed
        part of a group is its members and the version that generated them."""
        record = self._record_first_turn
        for sample in self.groups[group_id].members[max(first, 0):first + size]:
            if sample.output_ids is None:
                record(sample, NO_OUTPUT, NO_LOGPROBS, [version], None, NO_MASK)

    def record_group(self, group_id: str, output: GroupOutput, sampling: protocol.TurnSampling) -> None:
        """Every member's first turn at once, sampled from `sampling`'s distribution."""
        members = self.groups[group_id].members
        if len(members) != output.n:
            raise ValueError(f"group {group_id} has {len(members)} samples; {output.n} outputs came back")
        record = self._record_first_turn
        for sample, ids, logprobs, version, served_by, finish_reason in zip(
                members, output.token_ids, output.logprobs, output.versions, output.served_by, output.finish_reasons):
            record(sample, ids, logprobs, [version], sampling)
            sample.served_by, sample.finish_reason = served_by, finish_reason

    @staticmethod
    def _record_first_turn(sample: Sample, output_ids: Sequence[int], logprobs: Sequence[float],
                           versions: list[int], sampling: protocol.TurnSampling | None,
                           mask: array.array | None = None) -> None:
        """`mask`: every output id trained, unless given (`NO_MASK` with `NO_OUTPUT`)."""
        if sample.output_ids is not None or sample.status != PENDING:
            raise DuplicateResult(f"sample {sample.sample_id} already has an output ({sample.status})")
        sample.output_ids = ids = token_array(output_ids)
        sample.logprobs = logprob_array(logprobs)
        sample.versions = list(versions)
        sample.mask = array.array("b", b"\x01" * len(ids)) if mask is None else mask
        sample.sampling = [sampling or DEFAULT_SAMPLING]

    def record_turn(self, sample_id: str, appended_ids: Sequence[int], output: GroupOutput,
                    sampling: protocol.TurnSampling | None = None) -> Sample:
        """A later turn of a conversation: `appended_ids` (not trained) then the turn's
        generated ids (trained, `output` a group of one), with `sampling`'s settings (its
        `start` is set here: where the turn's ids begin)."""
        sample = self.samples.get(sample_id)
        if sample is None:
            raise KeyError(f"unknown sample {sample_id}")
        if sample.output_ids is None or sample.status != PENDING or sample.reward is not None:
            raise ValueError(f"sample {sample_id} cannot take another turn: it is {sample.status}"
                             + (" and already rewarded" if sample.reward is not None else ""))
        assert sample.logprobs is not None and sample.mask is not None  # set with its output_ids
        turn = sampling or DEFAULT_SAMPLING
        generated = output.token_ids[0]
        start = len(sample.output_ids) + len(appended_ids)
        sample.sampling.append(protocol.TurnSampling(start, turn.temperature, turn.top_p, turn.top_k))
        sample.output_ids.extend(appended_ids)
        sample.output_ids.extend(generated)
        sample.logprobs.extend(array.array(protocol.LOGPROB_TYPECODE, bytes(4 * len(appended_ids))))
        sample.logprobs.extend(output.logprobs[0])
        sample.mask.frombytes(b"\x00" * len(appended_ids) + b"\x01" * len(generated))
        sample.versions.append(output.versions[0])
        sample.served_by, sample.finish_reason = output.served_by[0], output.finish_reasons[0]
        return sample

    def annotate(self, sample_id: str, text: str, messages: list | None) -> None:
        """The last turn's text and the conversation so far, as the episode context made them."""
        sample = self.samples[sample_id]
        sample.text, sample.messages = text, messages

    def view(self, sample_id: str) -> SampleView:
        return SampleView(self.samples[sample_id])

    def set_reward(self, sample_id: str, reward: float) -> None:
        sample = self.samples[sample_id]
        if self._accept_reward(sample, reward):
            group = self.groups[sample.group_id]
            group.rewarded = rewarded = group.rewarded + 1
            if rewarded == len(group.sample_ids):
                self._maybe_ready(group)

    def set_group_rewards(self, group_id: str, rewards: Sequence[float]) -> None:
        """The rewards of the group's members, in order (as many as given): what
        `set_reward` of each in turn does, in one call."""
        group = self.groups[group_id]
        size = len(group.sample_ids)
        for sample, reward in zip(group.members, rewards):
            if self._accept_reward(sample, reward):
                group.rewarded = rewarded = group.rewarded + 1
                if rewarded == size:
                    self._maybe_ready(group)

    @staticmethod
    def _accept_reward(sample: Sample, reward: float) -> bool:
        """Sets a pending sample's reward; False (nothing set) if its group was dropped."""
        if sample.status == DROPPED:
            return False  # its group was dropped meanwhile (its episode failed)
        if sample.status != PENDING:
            raise ValueError(f"reward for {sample.sample_id} arrived after its group was complete ({sample.status}): "
                             f"its advantages are already fixed, so this reward would be ignored. Set every "
                             f"sample's reward before the last one of its group")
        if sample.reward is not None:
            raise ValueError(f"reward for {sample.sample_id} set twice ({sample.reward} then {reward})")
        if not math.isfinite(reward):
            raise ValueError(f"reward for {sample.sample_id} is not finite: {reward}")
        sample.reward = float(reward)
        return True

    def drop_group(self, group_id: str, why: str) -> None:
        group = self.groups[group_id]
        if group.status != PENDING:
            return
        self.emit(ev.SamplesDropped(group.agent, list(group.sample_ids), why))
        group.status = DROPPED
        for sample in group.members:
            sample.status = DROPPED
        self.counts[(group.agent, DROPPED)] += len(group.sample_ids)

    def record_teacher(self, group_id: str, logprobs: Sequence[Sequence[float]], versions: list[int]) -> None:
        """A distilled agent's group scored by its teacher: member j's teacher logprobs (one
        per output id) from the teacher's policy version `versions[j]`; the group becomes
        trainable now if every member has its reward."""
        group = self.groups[group_id]
        if group.status != PENDING:
            return  # dropped meanwhile (its episode failed)
        for sample, lps in zip(group.members, logprobs):
            if sample.output_ids is None or len(lps) != len(sample.output_ids):
                raise ValueError(f"{sample.sample_id}: {len(lps)} teacher logprobs for "
                                 f"{0 if sample.output_ids is None else len(sample.output_ids)} output ids")
            sample.teacher_logprobs = logprob_array(lps)
        self.emit(ev.TeacherScored(group.agent, group_id, group.batch, self.teachers.get(group.agent, ""),
                                   list(versions)))
        if group.rewarded == len(group.members):
            self._maybe_ready(group)

    def serve_group(self, group_id: str) -> None:
        """A frozen agent's group whose episode ended: generated, never to be trained (its
        rewards, if the workflow gave any, are recorded with it); then let go."""
        group = self.groups[group_id]
        if group.status != PENDING or any(s.output_ids is None for s in group.members):
            return
        self.emit(ev.GroupServed(group.agent, group_id, len(group.members),
                                 [s.reward for s in group.members if s.reward is not None]))
        group.status = SERVED
        for sample in group.members:
            sample.status = SERVED
        self.counts[(group.agent, SERVED)] += len(group.members)
        for listener in self.on_served:
            listener(group)
        self.forget(group.members)

    def _maybe_ready(self, group: Group) -> None:
        if group.status != PENDING or group.agent in self.frozen:  # a frozen agent's: served at its episode's end
            return
        if group.agent in self.teachers and any(s.teacher_logprobs is None for s in group.members):
            return  # not scored by its teacher yet
        members = group.members
        rewards, tokens = [], len(members[0].prompt_ids)
        for s in members:
            reward, output = s.reward, s.output_ids
            if reward is None or output is None:
                return
            rewards.append(reward)
            tokens += len(output)
        agent, batch = group.agent, group.batch
        group.tokens = tokens
        self.emit(ev.GroupComplete(agent, group.group_id, rewards, tokens))  # the event keeps the list
        if agent in self.dynamic:
            why = decisions.dynamic_drop(rewards, self._kept[(agent, batch)], self._targets.get((agent, batch)))
            if why:
                self.dynamic_drops[(agent, batch, why)] += 1
                self.drop_group(group.group_id, why)
                return
            self._kept[(agent, batch)] += 1
        seq = next(self._ready_seq)
        for s, adv in zip(members, group_advantages(rewards, by_std=self.std_normalized.get(agent, True))):
            s.advantage, s.status, s.ready_seq = adv, READY, seq
        group.status = READY
        queues = self.ready[agent]
        queue = queues.get(batch)
        if queue is None:
            queues[batch] = queue = collections.deque()
        queue.append(group.group_id)
        self._ready_count[(agent, batch)] += len(members)
        for listener in self.on_ready:
            listener(group)

    # ---------------------------------------------------------------- dynamic sampling

    def groups_opened(self, agent: str, batch: int) -> int:
        return self._opened[(agent, batch)]

    def groups_kept(self, agent: str, batch: int) -> int:
        """A dynamic-sampling agent's groups of `batch` that became trainable."""
        return self._kept[(agent, batch)]

    def set_target(self, agent: str, batch: int, groups: int) -> None:
        """The groups `agent` trains in `batch` (its regular episodes'): more from extra
        episodes are surplus (`decisions.dynamic_drop`)."""
        self._targets[(agent, batch)] = groups

    # ---------------------------------------------------------------- training side

    def ready_samples(self, agent: str, batch: int) -> int:
        return self._ready_count[(agent, batch)]

    def ready_size(self, agent: str, batch: int, size: decisions.MicroBatchSize) -> int:
        """What is ready, in samples or tokens as `size` counts."""
        if not size.tokens:  # counted as groups become ready and are taken
            return self._ready_count[(agent, batch)]
        return sum(size.of_group(self.groups[g]) for g in self.ready[agent].get(batch, ()))

    def take(self, agent: str, batch: int, size: decisions.MicroBatchSize) -> list[Sample]:
        """Whole ready groups of global batch `batch`, oldest first, up to `size`'s limit
        (at least one group if any is ready: a group is never split)."""
        taken: list[Sample] = []
        queue = self.ready[agent].get(batch, collections.deque())
        groups = self.groups
        sizes = (size.of_group(groups[g]) for g in queue)  # read lazily: stops at the cut
        for _ in range(decisions.groups_in_micro_batch(sizes, size.limit)):
            group = groups[queue.popleft()]
            group.status = CONSUMED
            self._ready_count[(agent, batch)] -= len(group.sample_ids)
            for sample in group.members:
                assert sample.status == READY, f"{sample.sample_id} is {sample.status}, not ready"
                sample.status = CONSUMED
            taken += group.members
            self.counts[(agent, CONSUMED)] += len(group.sample_ids)
        return taken

    def form_micro_batches(self, agent: str, batch: int, size: decisions.MicroBatchSize, complete: bool,
                           overlap: bool, max_staleness: int) -> list[list[Sample]]:
        """Takes every micro-batch the rules allow now for `agent`'s global batch `batch`,
        each of `size` (`decisions.cut_micro_batch`). A group with any turn older than the
        staleness bound is dropped here, never trained (`decisions.split_stale`)."""
        formed = []
        while decisions.cut_micro_batch(self.ready_size(agent, batch, size), size.limit, complete, overlap):
            kept, stale = decisions.split_stale(self.take(agent, batch, size), batch, max_staleness)
            if stale:
                log.error("dropping %d samples of %s older than the staleness bound %d", len(stale), agent,
                          max_staleness)
                self.reject(stale, f"lag above max_staleness={max_staleness}")
            if kept:
                formed.append(kept)
        return formed

    def reject(self, samples: list[Sample], why: str) -> None:
        """Marks taken samples dropped instead of trained (e.g. found too stale)."""
        if samples:
            self.emit(ev.SamplesDropped(samples[0].agent, [s.sample_id for s in samples], why))
        for s in samples:
            s.status = DROPPED
        agent = samples[0].agent if samples else ""
        self.counts[(agent, CONSUMED)] -= len(samples)
        self.counts[(agent, DROPPED)] += len(samples)
        for group_id in {s.group_id for s in samples}:
            self.groups[group_id].status = DROPPED

    def forget(self, samples: Iterable[Sample]) -> None:
        """Lets trained samples (whole groups, as `take` hands them out) go: a long run's
        store holds what is in flight and not yet committed, not its history (the counts
        stay; the event log has the rest)."""
        records, groups = self.samples, self.groups
        for s in samples:
            s.prompt_ids, s.output_ids, s.logprobs, s.mask = [], NO_OUTPUT, NO_LOGPROBS, NO_MASK
            s.teacher_logprobs = None
            records.pop(s.sample_id, None)
            groups.pop(s.group_id, None)


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
