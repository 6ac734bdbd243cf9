"""Every sample of a run and the episode it belongs to, read from the event log, for the
page's list of samples (filtered by agent, step, reward and what became of them) and its
episodes (one opened as its tree of groups across agents).

The log names a group when it opens (`GroupOpened`: its typed key, batch, members), which
instance generated which members and under which policy version (`RequestsCompleted`,
a later turn of a conversation by its turn number), the members' rewards (`GroupComplete`),
the micro-batch each went into (`MicroBatchFormed`), whether that step was taken
(`OptimizerStep`) and what was dropped and why (`SamplesDropped`). A group's place in its
episode (which episode, which branch of its tree of tasks) is read back from the group's
key by the rule that made it (`episodes.workflow.group_place`); advantages are computed by
the store's own rule (`state.store.group_advantages`). What an agent said is in
samples.jsonl for the samples a run recorded (`run.samples_per_step`): the index keeps
where each recorded sample's line is (found by the line's group key and member) and reads
it when a page asks.

Per sample, the index keeps a few numbers in growing numpy columns (about 30 bytes a
sample) and per group its key: a run of a million samples stays in tens of megabytes, and
a filter over all of them is one vectorised pass. Events of types it does not read are
passed over; it never trusts the log to be consistent (a member it cannot place is
skipped).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from flexmarl.runtime.events import (
    Event,
    GroupComplete,
    GroupOpened,
    MicroBatchFormed,
    OptimizerStep,
    Parts,
    RequestsCompleted,
    RunResumed,
    SamplesDropped,
    TrainingRestored,
)
from flexmarl.runtime.keys import GroupKey
from flexmarl.runtime.legacy_events import LegacyReader

from ..episodes.workflow import group_place
from ..state.store import group_advantages

# What became of a sample, as the list filters it.
STATUSES = ("trained", "in micro-batch", "dropped", "ready", "generated", "opened")


class Column:
    """A numpy array that grows by doubling; `view()` is its filled part."""

    def __init__(self, dtype: Any, fill: Any) -> None:
        self.fill = fill
        self.data = np.full(1024, fill, dtype=dtype)
        self.n = 0

    def grow(self, n: int) -> None:
        """Room for `n` entries (new ones hold the fill value)."""
        if n > len(self.data):
            data = np.full(max(n, 2 * len(self.data)), self.fill, dtype=self.data.dtype)
            data[:self.n] = self.data[:self.n]
            self.data = data
        self.n = max(self.n, n)

    def view(self) -> np.ndarray:
        return self.data[:self.n]


class EpisodeIndex:
    """The samples of a run, by index (a group's members are consecutive), and its episodes.
    `read(events)` takes the log a part at a time, in order; `texts` are added as
    samples.jsonl grows (`add_text`) and read back through `read_text`."""

    def __init__(self, read_text: Callable[[int], dict[str, Any] | None],
                 std_normalized: Callable[[str], bool] = lambda agent: True) -> None:
        self.read_text = read_text  # samples.jsonl's row at a byte offset
        self.std_normalized = std_normalized  # agent -> its advantages are divided by the group's std
        self.agents: list[str] = []
        self.workers: list[str] = []
        self._agent_index: dict[str, int] = {}
        self._worker_index: dict[str, int] = {}
        # per group
        self.group_keys: list[GroupKey] = []
        self.group_of: dict[GroupKey, int] = {}
        self.g_agent, self.g_batch = Column(np.int32, -1), Column(np.int32, -1)
        self.g_first, self.g_n = Column(np.int64, 0), Column(np.int32, 0)
        self.g_episode = Column(np.int32, -1)
        # per episode
        self.episodes: list[str] = []
        self.episode_of: dict[str, int] = {}
        self.episode_groups: list[list[int]] = []
        # per sample
        self.s_group = Column(np.int32, -1)
        self.s_reward = Column(np.float64, math.nan)
        self.s_version = Column(np.int32, -1)  # its first turn's
        self.s_worker = Column(np.int32, -1)  # the instance of its first turn
        self.s_formed = Column(np.int32, -1)  # the version its micro-batch trains into
        self.s_dropped = Column(np.int32, 0)  # 0, or 1 + the index of the reason
        self.s_text = Column(np.int64, -1)  # the byte offset of its line in samples.jsonl
        self.later_turns: dict[int, list[tuple[int, int]]] = {}  # sample -> (version, instance) of turns 2, 3, ...
        self.reasons: list[str] = []
        self._reason_index: dict[str, int] = {}
        self.stepped: set[tuple[int, int]] = set()  # (agent, version): that optimizer step is logged
        self._waiting_texts: dict[GroupKey, list[tuple[int, int]]] = {}  # group -> (member, offset): lines ahead of the log

    @property
    def samples(self) -> int:
        return self.s_group.n

    # ------------------------------------------------------------ reading

    def read(self, events: list[Event]) -> None:
        """The next part of the log. The groups it opens are made first, in bulk (whatever
        else the part says of a group comes after its opening in the log), unless the part
        holds a resume, after which a group may be opened again: then all in order."""
        readers = _READERS
        if not any(type(e) is RunResumed for e in events):
            self._open([e for e in events if type(e) is GroupOpened])
            readers = _AFTER_OPENING
        for e in events:
            reader = readers.get(type(e))
            if reader is not None:
                reader(self, e)

    def add_text(self, offset: int, row: dict[str, Any]) -> None:
        named = _sample_of_row(row)
        if named is None:
            return
        key, member = named
        s = self._sample(key, member)
        if s is not None:
            self.s_text.data[s] = offset
            return
        self._waiting_texts.setdefault(key, []).append((member, offset))  # a line ahead of the log: kept until its group opens

    def forget_texts(self) -> None:
        """samples.jsonl started over (a resumed run rewrote it): its lines are added again."""
        self.s_text.data[:] = -1
        self._waiting_texts.clear()

    def _opened(self, e: GroupOpened) -> None:
        self._open([e])

    def _open(self, opened: list[GroupOpened]) -> None:
        new = []
        for e in opened:
            g = self.group_of.get(e.key)
            if g is None:
                new.append(e)
            else:  # opened again: a resumed run generates the batches after its checkpoint anew
                self._reopen(g, max(e.n, 0))
        if not new:
            return
        g0, first, sizes = len(self.group_keys), self.samples, [max(e.n, 0) for e in new]
        firsts = np.cumsum([first] + sizes[:-1])
        total = sum(sizes)
        for column in (self.g_agent, self.g_batch, self.g_first, self.g_n, self.g_episode):
            column.grow(g0 + len(new))
        for column in (self.s_group, self.s_reward, self.s_version, self.s_worker, self.s_formed,
                       self.s_dropped, self.s_text):
            column.grow(first + total)
        span = slice(g0, g0 + len(new))
        self.g_agent.data[span] = [self._index(e.agent, self.agents, self._agent_index) for e in new]
        self.g_batch.data[span] = [e.batch for e in new]
        self.g_first.data[span], self.g_n.data[span] = firsts, sizes
        self.s_group.data[first:first + total] = np.repeat(np.arange(g0, g0 + len(new)), sizes)
        episodes = []
        for g, e in enumerate(new, start=g0):
            self.group_keys.append(e.key)
            self.group_of[e.key] = g
            place = group_place(e.key)
            episode = place.episode if place is not None else str(e.key)
            ep = self.episode_of.get(episode)
            if ep is None:
                ep = self.episode_of[episode] = len(self.episodes)
                self.episodes.append(episode)
                self.episode_groups.append([])
            self.episode_groups[ep].append(g)
            episodes.append(ep)
            waiting = self._waiting_texts.pop(e.key, None) if self._waiting_texts else None
            for member, offset in waiting or ():
                if member < sizes[g - g0]:
                    self.s_text.data[firsts[g - g0] + member] = offset
        self.g_episode.data[span] = episodes

    def _reopen(self, g: int, n: int) -> None:
        first, before = int(self.g_first.data[g]), int(self.g_n.data[g])
        self._clear(first, before)
        if before != n:  # its old members stay behind, marked, and new ones are made
            self.s_dropped.data[first:first + before] = 1 + self._index(
                "opened again with another size", self.reasons, self._reason_index)
            self.g_first.data[g], self.g_n.data[g] = self._new_samples(g, n), n

    def _new_samples(self, g: int, n: int) -> int:
        first = self.samples
        for column in (self.s_group, self.s_reward, self.s_version, self.s_worker, self.s_formed,
                       self.s_dropped, self.s_text):
            column.grow(first + n)
        self.s_group.data[first:first + n] = g
        return first

    def _clear(self, first: int, n: int) -> None:
        for column in (self.s_reward, self.s_version, self.s_worker, self.s_formed, self.s_dropped):
            column.data[first:first + n] = column.fill
        for s in range(first, first + n):
            self.later_turns.pop(s, None)

    def _completed(self, e: RequestsCompleted) -> None:
        w = self._index(e.worker, self.workers, self._worker_index)
        for (key, first, size, turn), version in zip(e.parts, e.versions):
            if turn:  # a later turn of a conversation (events.Parts): member `first` alone
                s = self._sample(key, first)
                if s is not None:
                    self.later_turns.setdefault(s, []).append((version, w))
                continue
            g = self.group_of.get(key)
            if g is not None and first + size <= self.g_n.data[g]:
                start = int(self.g_first.data[g]) + first
                self.s_version.data[start:start + size] = version
                self.s_worker.data[start:start + size] = w

    def _complete(self, e: GroupComplete) -> None:
        g = self.group_of.get(e.key)
        if g is not None and len(e.rewards) == self.g_n.data[g]:
            first = int(self.g_first.data[g])
            self.s_reward.data[first:first + len(e.rewards)] = e.rewards

    def _formed(self, e: MicroBatchFormed) -> None:
        formed = self.s_formed.data
        for s in self._samples_of(e.parts):
            formed[s] = e.version

    def _stepped(self, e: OptimizerStep) -> None:
        self.stepped.add((self._index(e.agent, self.agents, self._agent_index), e.version))

    def _dropped(self, e: SamplesDropped) -> None:
        reason = 1 + self._index(e.why, self.reasons, self._reason_index)
        for s in self._samples_of(e.parts):
            self.s_dropped.data[s] = reason

    def _restored(self, e: TrainingRestored) -> None:
        """What was trained into versions after `e.version` no longer counts (trained again)."""
        agent = self._agent_index.get(e.agent)
        self.stepped = {(a, v) for a, v in self.stepped if a != agent or v <= e.version}

    def _resumed(self, e: RunResumed) -> None:
        """The steps after the checkpoint are taken again."""
        self.stepped = {(a, v) for a, v in self.stepped if v <= e.step}

    @staticmethod
    def _index(name: str, names: list[str], index: dict[str, int]) -> int:
        i = index.get(name)
        if i is None:
            i = index[name] = len(names)
            names.append(name)
        return i

    def _samples_of(self, parts: Parts) -> list[int]:
        """The indices of the first-turn members `parts` names that were opened."""
        found: list[int] = []
        group_of, g_first, g_n = self.group_of, self.g_first.data, self.g_n.data
        for key, first, size, turn in parts:
            g = group_of.get(key)
            if g is None or turn:
                continue
            start, n = int(g_first[g]), int(g_n[g])
            found += range(start + first, start + min(first + size, n))
        return found

    def _sample(self, key: GroupKey, member: int) -> int | None:
        """The index of member `member` of the group `key`, or None where no such member was opened."""
        g = self.group_of.get(key)
        if g is None or not 0 <= member < self.g_n.data[g]:
            return None
        return int(self.g_first.data[g]) + member

    # ------------------------------------------------------------ asking

    def status(self, samples: np.ndarray | slice = slice(None)) -> np.ndarray:
        """The index into STATUSES of each of `samples` (indices; all of them by default)."""
        n = self.samples
        formed, dropped = self.s_formed.data[:n][samples], self.s_dropped.data[:n][samples]
        agent = self.g_agent.data[self.s_group.data[:n][samples]]
        codes = agent.astype(np.int64) << 32 | formed.astype(np.int64) & 0xFFFFFFFF
        taken = np.fromiter((a << 32 | v & 0xFFFFFFFF for a, v in self.stepped), dtype=np.int64, count=len(self.stepped))
        out: np.ndarray = np.full(len(formed), STATUSES.index("opened"), dtype=np.int8)
        out[self.s_version.data[:n][samples] >= 0] = STATUSES.index("generated")
        out[~np.isnan(self.s_reward.data[:n][samples])] = STATUSES.index("ready")
        out[formed >= 0] = STATUSES.index("in micro-batch")
        out[dropped > 0] = STATUSES.index("dropped")
        out[(formed >= 0) & np.isin(codes, taken)] = STATUSES.index("trained")
        return out

    def select(self, agent: str | None = None, steps: tuple[int | None, int | None] = (None, None),
               rewards: tuple[float | None, float | None] = (None, None), status: str | None = None,
               with_text: bool = False, order: str = "step") -> np.ndarray:
        """The indices of the samples that pass every filter given, in `order` ("step": as
        opened; "reward" or "-reward": by reward, ascending or descending)."""
        n = self.samples
        keep: np.ndarray = np.ones(n, dtype=bool)
        groups = self.s_group.view()
        if agent is not None:
            if agent not in self._agent_index:
                return np.zeros(0, dtype=np.int64)
            keep &= self.g_agent.data[groups] == self._agent_index[agent]
        if steps != (None, None):
            batch = self.g_batch.data[groups]
            if steps[0] is not None:
                keep &= batch >= steps[0]
            if steps[1] is not None:
                keep &= batch <= steps[1]
        reward = self.s_reward.view()
        if rewards[0] is not None:
            keep &= reward >= rewards[0]
        if rewards[1] is not None:
            keep &= reward <= rewards[1]
        if status is not None:
            keep &= self.status() == STATUSES.index(status)
        if with_text:
            keep &= self.s_text.view() >= 0
        chosen = np.flatnonzero(keep)
        if order in ("reward", "-reward"):
            by = reward[chosen]
            chosen = chosen[np.argsort(-by if order == "-reward" else by, kind="stable")]
        return chosen

    def rows(self, chosen: np.ndarray) -> list[dict[str, Any]]:
        """The list's row of each sample in `chosen`."""
        status = dict(zip(chosen.tolist(), self.status(chosen).tolist()))
        out = []
        for s in chosen.tolist():
            g = int(self.s_group.data[s])
            row = self._member(s, g, self._advantages(g))
            row.update(episode=self.episodes[self.g_episode.data[g]], agent=self.agents[self.g_agent.data[g]],
                       step=int(self.g_batch.data[g]), status=STATUSES[status[s]])
            out.append(row)
        return out

    def episode(self, name: str) -> dict[str, Any] | None:
        """An episode's groups in the order they opened, each with its branch and members."""
        ep = self.episode_of.get(name)
        if ep is None:
            return None
        members = np.concatenate([np.arange(self.g_first.data[g], self.g_first.data[g] + self.g_n.data[g])
                                  for g in self.episode_groups[ep]])
        status = dict(zip(members.tolist(), self.status(members).tolist()))
        groups = []
        for g in self.episode_groups[ep]:
            agent = self.agents[self.g_agent.data[g]]
            key = self.group_keys[g]
            place = group_place(key)
            first, n = int(self.g_first.data[g]), int(self.g_n.data[g])
            advantages = self._advantages(g)
            members = []
            for s in range(first, first + n):
                member = self._member(s, g, advantages)
                member["status"] = STATUSES[status[s]]
                offset = int(self.s_text.data[s])
                text = self.read_text(offset) if offset >= 0 else None
                if text is not None:
                    member["turns"] = text.get("turns", [])
                    member["versions"] = text.get("versions", member["versions"])
                members.append(member)
            groups.append({"group": str(key), "agent": agent, "step": int(self.g_batch.data[g]),
                           "branch": list(place.branch) if place is not None else [], "members": members})
        return {"episode": name, "groups": groups}

    def _advantages(self, g: int) -> list[float] | None:
        first, n = int(self.g_first.data[g]), int(self.g_n.data[g])
        rewards = self.s_reward.data[first:first + n]
        if n == 0 or np.isnan(rewards).any():
            return None
        return group_advantages(rewards.tolist(), by_std=self.std_normalized(self.agents[self.g_agent.data[g]]))

    def _member(self, s: int, g: int, advantages: list[float] | None) -> dict[str, Any]:
        first = int(self.g_first.data[g])
        reward = float(self.s_reward.data[s])
        versions, instances = [int(self.s_version.data[s])], [int(self.s_worker.data[s])]
        for version, worker in self.later_turns.get(s, ()):
            versions.append(version)
            instances.append(worker)
        formed, dropped = int(self.s_formed.data[s]), int(self.s_dropped.data[s])
        return {"sample": self.group_keys[g].sample(s - first), "member": s - first,
                "reward": None if math.isnan(reward) else reward,
                "advantage": round(advantages[s - first], 4) if advantages is not None else None,
                "versions": [v for v in versions if v >= 0],
                "instances": [self.workers[w] for w in instances if w >= 0],
                "trained_into": formed if formed >= 0 else None,
                "dropped": self.reasons[dropped - 1] if dropped else None,
                "text": bool(self.s_text.data[s] >= 0)}


# What EpisodeIndex.read does with each event type it reads; others are passed over.
_AFTER_OPENING: dict[type, Callable[[EpisodeIndex, Any], None]] = {
    RequestsCompleted: EpisodeIndex._completed, GroupComplete: EpisodeIndex._complete,
    MicroBatchFormed: EpisodeIndex._formed, OptimizerStep: EpisodeIndex._stepped,
    SamplesDropped: EpisodeIndex._dropped, TrainingRestored: EpisodeIndex._restored,
    RunResumed: EpisodeIndex._resumed}
_READERS: dict[type, Callable[[EpisodeIndex, Any], None]] = {GroupOpened: EpisodeIndex._opened, **_AFTER_OPENING}


def _sample_of_row(row: dict[str, Any]) -> tuple[GroupKey, int] | None:
    """The sample a line of samples.jsonl is of: its `group` key and `member`, or, in a line
    written before those were (`sample_id` alone), the sample its id names."""
    group, member = row.get("group"), row.get("member")
    if isinstance(group, list) and len(group) == 3 and all(isinstance(x, str) for x in group) \
            and type(member) is int and member >= 0:
        return GroupKey(*group), member
    sample_id, agent = row.get("sample_id"), row.get("agent")
    if not isinstance(sample_id, str) or not isinstance(agent, str):
        return None
    key, member, turn = LegacyReader().sample(agent, sample_id)
    return None if turn else (key, member)
