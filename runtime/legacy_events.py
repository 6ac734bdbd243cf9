"""Event logs of formats 1 to 3, read as format 4: where groups and samples were strings.

Before format 4 a group was named by a string id (`EPISODE/AGENT-CALL`), a sample by its
group's id and its index (`GROUP/INDEX`), a later turn of a sample by the sample's id and
the turn (`SAMPLE@TURN`), and format 1 listed a group's sample ids one by one. This module
declares the eight event types whose fields held those strings as they were, and
`LegacyReader` turns each into its format-4 event (runtime/keys.py's typed keys, parts of
groups): the one place those strings are ever read. The same string always gives the same
key, so every event of an old log still names the same groups and samples: replay, its
check and its accounting read old logs exactly as new ones.

A string that is not of the old grammar (a hand-made log's) becomes a group of its own
(episode "", its whole text as the call), which still names it consistently.

Plain data: no files (eventlog.py reads them), no controller.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import msgspec

from . import events as ev
from .keys import SCORE_TURN, GroupKey

# The first format whose events name groups by typed keys.
TYPED_FORMAT = 4


class Parts(msgspec.Struct, array_like=True, gc=False):
    keys: list[str] = []
    firsts: list[int] = []
    sizes: list[int] = []


class RequestsDispatched(ev.Event, tag="RequestsDispatched"):
    worker: str
    agent: str
    request_id: int
    sample_ids: list[str]  # format 1 (formats 2 and 3 name them in `parts`)
    tokens: int
    parts: Parts = msgspec.field(default_factory=Parts)


class RequestsCompleted(ev.Event, tag="RequestsCompleted"):
    worker: str
    agent: str
    request_id: int
    sample_ids: list[str]  # format 1
    versions: list[int]  # per sample (format 1), per part (formats 2 and 3)
    tokens: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    turn_prompt_tokens: int = 0
    turn_cached_tokens: int = 0
    parts: Parts = msgspec.field(default_factory=Parts)


class GroupOpened(ev.Event, tag="GroupOpened"):
    agent: str
    group_id: str
    sample_ids: list[str]  # format 1 (formats 2 and 3: `n`, the members GROUP/0 .. GROUP/n-1)
    batch: int = msgspec.field(name="tag")
    n: int = 0


class GroupComplete(ev.Event, tag="GroupComplete"):
    agent: str
    group_id: str
    rewards: list[float]
    tokens: int = 0


class SamplesDropped(ev.Event, tag="SamplesDropped"):
    agent: str
    sample_ids: list[str]
    why: str


class MicroBatchFormed(ev.Event, tag="MicroBatchFormed"):
    agent: str
    trainer: str
    version: int
    sample_ids: list[str]
    min_versions: list[int]


class TeacherScored(ev.Event, tag="TeacherScored"):
    agent: str
    group_id: str
    batch: int
    teacher: str
    versions: list[int]


class GroupServed(ev.Event, tag="GroupServed"):
    agent: str
    group_id: str
    n: int
    rewards: list[float] = []


_LEGACY = (TeacherScored, GroupServed, RequestsDispatched, RequestsCompleted, GroupOpened, GroupComplete, SamplesDropped, MicroBatchFormed)
_CHANGED = frozenset(cls.__name__ for cls in _LEGACY)
# What a frame of formats 1 to 3 may hold: the eight above as they were, the rest as now.
AnyLegacyEvent = Union[tuple(_LEGACY) + tuple(c for c in ev.EVENT_TYPES if c.__name__ not in _CHANGED)]  # type: ignore[valid-type]

Sample = tuple[GroupKey, int, int]  # (group, member, turn)


class LegacyReader:
    """Turns the events of one old log, in order, into format-4 events. Keeps what format 1
    said of its groups' members (their ids listed), so later events naming them find them."""

    def __init__(self) -> None:
        self._listed: dict[str, tuple[GroupKey, int]] = {}  # format 1: a listed member's id -> (group, index)
        # A group's id -> its key, as opened: another agent's event naming it (a teacher's
        # scoring of a member) finds the opener's key.
        self._group_keys: dict[str, GroupKey] = {}

    def __call__(self, e: ev.Event) -> ev.Event:
        read = _READERS.get(type(e))
        return e if read is None else read(self, e)

    # ---------------------------------------------------------------- names

    def group(self, agent: str, text: str) -> GroupKey:
        known = self._group_keys.get(text)
        if known is not None:
            return known
        episode, sep, rest = text.partition("/")
        if sep and rest.startswith(f"{agent}-"):
            return GroupKey(episode, agent, rest[len(agent) + 1:])
        return GroupKey("", agent, text)

    def sample(self, agent: str, text: str) -> Sample:
        listed = self._listed.get(text)
        if listed is not None:
            return listed[0], listed[1], 0
        base, at, after = text.rpartition("@")
        turn = _index(after) if at else None
        if at and after == "teacher":  # a teacher's scoring of the member
            turn = SCORE_TURN
        if turn is not None:
            key, member, _ = self.sample(agent, base)
            return key, member, turn
        group, slash, last = text.rpartition("/")
        index = _index(last)
        if slash and index is not None:
            return self.group(agent, group), index, 0
        return GroupKey("", agent, text), 0, 0

    def parts(self, agent: str, texts: list[str], versions: list[int] | None = None) -> tuple[ev.Parts, list[int]]:
        """Samples named one by one as parts (consecutive members of a group, of one turn
        and one version, joined), and the version of each part."""
        keys: list[GroupKey] = []
        firsts: list[int] = []
        sizes: list[int] = []
        turns: list[int] = []
        merged: list[int] = []
        for i, text in enumerate(texts):
            key, member, turn = self.sample(agent, text)
            version = versions[i] if versions is not None else 0
            if (keys and not turn and not turns[-1] and keys[-1] == key and firsts[-1] + sizes[-1] == member
                    and merged[-1] == version):
                sizes[-1] += 1
                continue
            keys.append(key)
            firsts.append(member)
            sizes.append(1)
            turns.append(turn)
            merged.append(version)
        return ev.Parts(keys, firsts, sizes, turns if any(turns) else []), merged

    def old_parts(self, agent: str, old: Parts) -> ev.Parts:
        keys, firsts, turns = [], [], []
        for text, first in zip(old.keys, old.firsts):
            if "@" in text:  # a later turn: the key was the turn's name
                key, member, turn = self.sample(agent, text)
            else:
                key, member, turn = self.group(agent, text), first, 0
            keys.append(key)
            firsts.append(member)
            turns.append(turn)
        return ev.Parts(keys, firsts, list(old.sizes), turns if any(turns) else [])

    # ---------------------------------------------------------------- events

    def _opened(self, e: GroupOpened) -> ev.Event:
        key = self._group_keys[e.group_id] = self.group(e.agent, e.group_id)
        for j, text in enumerate(e.sample_ids):
            self._listed[text] = (key, j)
        return _stamped(ev.GroupOpened(key, e.batch, len(e.sample_ids) or e.n), e)

    def _complete(self, e: GroupComplete) -> ev.Event:
        return _stamped(ev.GroupComplete(self.group(e.agent, e.group_id), e.rewards, e.tokens), e)

    def _scored(self, e: TeacherScored) -> ev.Event:
        return _stamped(ev.TeacherScored(self.group(e.agent, e.group_id), e.batch, e.teacher, e.versions), e)

    def _served(self, e: GroupServed) -> ev.Event:
        return _stamped(ev.GroupServed(self.group(e.agent, e.group_id), e.n, e.rewards), e)

    def _dropped(self, e: SamplesDropped) -> ev.Event:
        return _stamped(ev.SamplesDropped(e.agent, self.parts(e.agent, e.sample_ids)[0], e.why), e)

    def _formed(self, e: MicroBatchFormed) -> ev.Event:
        return _stamped(ev.MicroBatchFormed(e.agent, e.trainer, e.version, self.parts(e.agent, e.sample_ids)[0],
                                            e.min_versions), e)

    def _dispatched(self, e: RequestsDispatched) -> ev.Event:
        parts = self.parts(e.agent, e.sample_ids)[0] if e.sample_ids else self.old_parts(e.agent, e.parts)
        return _stamped(ev.RequestsDispatched(e.worker, e.agent, e.request_id, e.tokens, parts), e)

    def _completed(self, e: RequestsCompleted) -> ev.Event:
        if e.sample_ids:  # format 1: a version per sample
            parts, versions = self.parts(e.agent, e.sample_ids[:len(e.versions)], e.versions)
        else:
            parts, versions = self.old_parts(e.agent, e.parts), e.versions
        return _stamped(ev.RequestsCompleted(e.worker, e.agent, e.request_id, versions, e.tokens, e.prompt_tokens,
                                             e.cached_tokens, e.turn_prompt_tokens, e.turn_cached_tokens, parts), e)


_READERS: dict[type, Callable[[LegacyReader, Any], ev.Event]] = {GroupOpened: LegacyReader._opened, GroupComplete: LegacyReader._complete,
            SamplesDropped: LegacyReader._dropped, MicroBatchFormed: LegacyReader._formed,
            RequestsDispatched: LegacyReader._dispatched, RequestsCompleted: LegacyReader._completed,
            TeacherScored: LegacyReader._scored, GroupServed: LegacyReader._served}


def _index(text: str) -> int | None:
    """The member index or turn a string names (digits, no sign, no leading zero), or None."""
    return int(text) if text.isdecimal() and str(int(text)) == text else None


def _stamped(new: ev.Event, old: ev.Event) -> ev.Event:
    new.seq, new.t = old.seq, old.t
    return new
