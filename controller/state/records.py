"""The experience store's record of a group, and the read-only views user code gets of it.

A `GroupRecord` is the n samples of one call, one columnar value: its key, its prompt's
ids once, and every member's output in packed buffers that share per-member offsets
(member j's output ids are `offsets[j]` to `offsets[j + 1]` of each): the ids themselves,
the sampler's logprob of each, the policy version that produced each, and (once a member
took a later turn) a mask of which ids it generated. Beside them, per member: the version
and sampling of its first turn, its later turns, the instance and finish reason of its last
turn, its reward and, once trainable, its advantage. A distilled agent's group gets its teacher's
logprob of every output id once scored, one more column of the same offsets. The group's
status is its members'.

A reply is kept as it arrived: a part's packed arrays are the buffers (several parts are
joined once, in member order). A later turn of member j makes new buffers with the turn's
ids in place (they are never changed in place, so a view handed out before keeps reading
what it read); every token carries its version, so a turn whose weights changed under it
(a load that let its request continue: the reply's `token_versions`) is kept as it came.
A member's staleness counts its oldest token: `oldest()` reads the members' turn versions,
and, once some member's first-turn tokens span versions, `token_oldest` (per member, the
oldest version of those tokens; what a re-drive of the event log refills, which keeps no
tokens). A later turn counts the version it was admitted under (its tokens are no older).

`SampleView` is one member as user code sees it: read-only, current (a later turn shows
through), and O(1) per access: token ids, logprobs, mask and versions are memoryviews of
the record's buffers (read-only by type), the conversation a snapshot made once per turn.

Only the store (store.py) writes records; nothing but the store and its views reads them.
Plain data: no sockets, no asyncio.
"""

from __future__ import annotations

import array
import itertools
import math
import struct
from types import MappingProxyType
from typing import Any, Sequence

import msgspec

from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey
from flexmarl.runtime.staleness import UNSPANNED, spanned_oldest

from .groups import GroupOutput

PENDING, READY, CONSUMED, DROPPED = "pending", "ready", "consumed", "dropped"
SERVED = "served"  # a frozen agent's: generated, never to be trained

TOKEN, LOGPROB = protocol.TOKEN_TYPECODE, protocol.LOGPROB_TYPECODE
_ITEM = {code: array.array(code).itemsize for code in (TOKEN, LOGPROB)}
# The per-member columns' codes: offsets (OFFSET, n + 1), first-turn versions (TOKEN),
# rewards and advantages (REWARD). Kept as bytes (bytearray where written per member), not
# array.array: the collector tracks an array, not bytes, and a run holds a few per group in
# flight, which every young pass of the collector walked.
OFFSET, REWARD = "q", "d"
_SPAN = struct.Struct(2 * OFFSET)  # member j's (from, to): offsets j and j + 1
_OFFSET = struct.Struct(OFFSET)
# A member whose first turn has not come back yet (its version, until then); in
# `token_oldest`, one whose first turn's tokens do not span versions.
NOT_YET = UNSPANNED


class DuplicateResult(Exception):
    """A result arrived for a sample that already has one (a retried request, say)."""


class TurnSampling(msgspec.Struct, frozen=True, gc=False):
    """The distribution a turn was sampled from (what the trainer scores it under), from
    output id `start` on (its first generated id) until the next turn's start."""

    start: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


# A first turn recorded without its settings (frozen: one value shared by every such group).
DEFAULT_SAMPLING = TurnSampling(0)


class Turn(msgspec.Struct, frozen=True, gc=False):
    """A later turn of a member: the version that generated it and what it was sampled at
    (`sampling.start`: its first generated id's position in the member's output)."""

    version: int
    sampling: TurnSampling


class GroupRecord(msgspec.Struct, gc=False):
    """One group's samples (see the module docstring). Plain data, written by the store only.
    Untracked by the collector (gc=False): no reference cycles, and a large run holds many."""

    key: GroupKey
    n: int
    batch: int  # the global batch that started it (continuous admission: that trains it, set at its episode's end)
    prompt: bytes  # TOKEN, native order
    # Outputs, every member's back to back (empty until they arrive); native order.
    tokens: bytes = b""
    logprobs: bytes = b""  # LOGPROB per token; 0.0 for ids appended between turns
    versions: bytes = b""  # TOKEN per token: the policy version that produced it (appended ids: their turn's)
    mask: bytes | None = None  # int8 per token: 1 generated (trained), 0 appended; None: all generated
    # On-policy distillation: LOGPROB per token, the teacher's (once scored; None: not yet, or no teacher).
    teacher_logprobs: bytes | None = None
    # With the agent's teacher_top_k k: per token, the teacher's k most likely ids (TOKEN) and
    # their logprobs (LOGPROB) at its position, k per token; native order; empty otherwise.
    teacher_top_ids: bytes = b""
    teacher_top_logprobs: bytes = b""
    # The per-member columns are bytes (see OFFSET): read through `span`, `firsts`, `reward`, ...
    offsets: bytes = b""  # OFFSET, n + 1 once outputs arrive
    first: bytes = b""  # TOKEN per member: its first turn's version (NOT_YET: not back yet)
    sampling: TurnSampling = DEFAULT_SAMPLING  # the members' first turn
    later: dict[int, list[Turn]] | None = None  # member -> its later turns, in order
    finish_reasons: tuple[str, ...] = ()  # per member: why its last turn ended
    served_by: tuple[str, ...] = ()  # per member: the instance of its last turn (its prefix cache has it)
    rewards: bytearray = msgspec.field(default_factory=bytearray)  # REWARD per member; NaN: not yet
    rewarded: int = 0
    advantages: bytes | None = None  # REWARD per member, once trainable
    status: str = PENDING
    size: int = 0  # once trainable: its prompt once plus every output (what a token budget counts)
    ready_seq: int = 0  # the order in which it became trainable, across every agent
    texts: list[str] | None = None  # per member: the last turn's text (agents with a tokenizer)
    messages: list[Any] | None = None  # per member: the conversation so far (ctx.chat), a snapshot
    # Per member, once some member's first-turn tokens span versions: the oldest version of
    # them (NOT_YET: its do not; its first turn's version says it).
    token_oldest: bytes | None = None  # TOKEN per member
    # `oldest()` as it was when the group became trainable (then it no longer changes; read
    # by the staleness check, the micro-batch's event, its wire message and the metrics).
    settled_oldest: bytes | None = None  # TOKEN per member

    @classmethod
    def opened(cls, key: GroupKey, prompt_ids: Sequence[int], n: int, batch: int) -> GroupRecord:
        return cls(key, n, batch, _packed(prompt_ids), first=_NOT_YET * n, rewards=bytearray(_NAN * n))

    # ---------------------------------------------------------------- reading

    @property
    def agent(self) -> str:
        return self.key.agent

    def span(self, member: int) -> tuple[int, int]:
        """Member's output: from, to (token positions in the buffers)."""
        offsets = self.offsets
        return _SPAN.unpack_from(offsets, 8 * member) if offsets else (0, 0)

    def output_size(self) -> int:
        """Every member's output ids together (0 before they arrived)."""
        return _OFFSET.unpack_from(self.offsets, 8 * self.n)[0] if self.offsets else 0

    def lengths(self) -> list[int]:
        """Per member: how many output ids it has."""
        if not self.offsets:
            return [0] * self.n
        offsets = memoryview(self.offsets).cast("q").tolist()  # OFFSET
        return [b - a for a, b in zip(offsets, offsets[1:])]

    def firsts(self) -> list[int]:
        """Per member: its first turn's version (NOT_YET: not back yet)."""
        return _ids(self.first).tolist()

    def has_output(self, member: int) -> bool:
        return _ids(self.first)[member] != NOT_YET

    def has_outputs(self) -> bool:
        """Every member's first turn came back."""
        return NOT_YET not in array.array(TOKEN, self.first)

    def rewards_list(self) -> list[float]:
        """Per member: its reward (NaN: not yet)."""
        return array.array("d", self.rewards).tolist()  # REWARD

    def advantages_list(self) -> list[float]:
        return array.array("d", self.advantages).tolist() if self.advantages is not None else []  # REWARD

    def turn_versions(self, member: int) -> list[int]:
        """The version of each of the member's turns ([] before its first came back)."""
        first = _ids(self.first)[member]
        if first == NOT_YET:
            return []
        turns = self.later.get(member) if self.later else None
        return [first] if not turns else [first, *(t.version for t in turns)]

    def oldest(self) -> list[int]:
        """Per member: the oldest version of any of its tokens, where its first turn's tokens
        span versions (`token_oldest`), else of any of its turns (a later turn counts the
        version it was admitted under: the oldest its tokens can be)."""
        if self.settled_oldest is not None:
            return _ids(self.settled_oldest).tolist()
        spans = self.token_oldest
        firsts = (_ids(self.first).tolist() if spans is None
                  else [f if s == NOT_YET else s for f, s in zip(_ids(self.first).tolist(), _ids(spans).tolist())])
        if not self.later:
            return firsts
        later = self.later
        return [min(f, *(t.version for t in later[j])) if j in later else f for j, f in enumerate(firsts)]

    def settle(self) -> None:
        """The group became trainable: `oldest()` is kept as it is now (writing a turn or a
        version after this forgets it), where it reads more than the first turns' versions
        (most groups': then reading those costs what reading a kept copy would)."""
        if self.later or self.token_oldest is not None:
            self.settled_oldest = array.array(TOKEN, self.oldest()).tobytes()

    def spanned(self) -> list[int]:
        """Per member: the oldest version of its first turn's tokens where they span versions
        (a load let their request continue), NOT_YET where not; empty: no member's do."""
        return _ids(self.token_oldest).tolist() if self.token_oldest is not None else []

    def note_oldest(self, first: int, oldest: Sequence[int]) -> None:
        """Members `first` on: `oldest`, per member, its first turn's oldest token's version
        where they span versions (NOT_YET where not)."""
        spans = None
        self.settled_oldest = None
        for j, version in enumerate(oldest, first):
            if version != NOT_YET and 0 <= j < self.n:
                if spans is None:
                    spans = bytearray(self.token_oldest if self.token_oldest is not None else _NOT_YET * self.n)
                _TOKEN.pack_into(spans, 4 * j, version)
        if spans is not None:
            self.token_oldest = bytes(spans)

    def turns_of(self, member: int) -> list[TurnSampling]:
        """What each of the member's turns was sampled at, the first's start 0."""
        turns = self.later.get(member) if self.later else None
        return [self.sampling] if not turns else [self.sampling, *(t.sampling for t in turns)]

    def reward(self, member: int) -> float | None:
        r = _REWARD.unpack_from(self.rewards, 8 * member)[0]
        return None if r != r else r  # NaN: not set

    def set_reward(self, member: int, reward: float) -> float | None:
        """Sets the member's reward unless it has one; returns the one it had (None: none)."""
        at = 8 * member
        before = _REWARD.unpack_from(self.rewards, at)[0]
        if before != before:  # NaN: not set
            _REWARD.pack_into(self.rewards, at, reward)
            return None
        return before

    # ---------------------------------------------------------------- writing (the store's)

    def record_outputs(self, output: GroupOutput, sampling: TurnSampling) -> None:
        """Every member's first turn, as the parts came back (each member once: a member
        that has its output already is refused, DuplicateResult, nothing changed)."""
        if self.offsets:
            raise DuplicateResult(f"group {self.key} already has its outputs ({self.status})")
        if output.n != self.n:
            raise ValueError(f"group {self.key} has {self.n} samples; {output.n} outputs came back")
        parts = output.parts
        if len(parts) == 1:
            (result, worker), = parts
            tokens, logprobs = protocol.native(TOKEN, result.token_ids), protocol.native(LOGPROB, result.logprobs)
            versions = (protocol.native(TOKEN, result.token_versions) if result.token_versions
                        else _repeated(result.version, len(tokens) // 4))
            self.first = _repeated(result.version, self.n)
            self.finish_reasons = _same(result.finish_reasons, self.n)
            self.served_by = _repeat(worker, self.n)
            lengths = result.lengths
        else:
            tokens = b"".join(protocol.native(TOKEN, r.token_ids) for r, _ in parts)
            logprobs = b"".join(protocol.native(LOGPROB, r.logprobs) for r, _ in parts)
            versions = b"".join(protocol.native(TOKEN, r.token_versions) if r.token_versions
                                else _repeated(r.version, sum(r.lengths)) for r, _ in parts)
            self.first = array.array(TOKEN, [r.version for r, _ in parts for _ in r.lengths]).tobytes()
            self.finish_reasons = tuple(f for r, _ in parts for f in (r.finish_reasons or [""] * len(r.lengths)))
            self.served_by = tuple(w for r, w in parts for _ in r.lengths)
            lengths = [length for r, _ in parts for length in r.lengths]
        self.tokens, self.logprobs, self.versions = tokens, logprobs, versions
        self.offsets = array.array(OFFSET, itertools.accumulate(lengths, initial=0)).tobytes()
        self.sampling = sampling
        if not any(r.token_versions for r, _ in parts):
            return
        member = 0
        for r, _ in parts:
            if r.token_versions:  # the part's members whose first turn's tokens span versions
                token_versions = _ids(protocol.native(TOKEN, r.token_versions))
                self.note_oldest(member, spanned_oldest(r.lengths, r.version, token_versions))
            member += len(r.lengths)

    def record_versions(self, first: int, size: int, version: int, oldest: Sequence[int] = ()) -> None:
        """Members `first` to `first + size - 1` without a first turn get an empty one from
        `version` (a re-drive from the event log, which keeps versions, not tokens); `oldest`,
        per member of the part, its tokens' oldest version where they spanned versions
        (NOT_YET where not; empty: none did)."""
        self.settled_oldest = None
        firsts = array.array(TOKEN, self.first)
        for j in range(max(first, 0), min(first + size, self.n)):
            if firsts[j] == NOT_YET:
                firsts[j] = version
        self.first = firsts.tobytes()
        self.note_oldest(first, oldest[:size])
        if not self.offsets:
            self.offsets = bytes(8 * (self.n + 1))
            self.finish_reasons, self.served_by = ("",) * self.n, ("",) * self.n

    def record_turn(self, member: int, appended_ids: Sequence[int], output: GroupOutput,
                    sampling: TurnSampling) -> None:
        """A later turn of `member`: `appended_ids` (not trained) then the turn's generated
        ids (`output`, a group of one), in new buffers with every other member's unmoved."""
        (result, worker), = output.parts
        self.settled_oldest = None
        a, b = self.span(member)
        appended = _packed(appended_ids)
        generated = protocol.native(TOKEN, result.token_ids)
        added, gen = len(appended) // 4, len(generated) // 4
        at, total = 4 * b, len(self.tokens) // 4
        self.tokens = self.tokens[:at] + appended + generated + self.tokens[at:]
        self.logprobs = (self.logprobs[:at] + bytes(4 * added) + protocol.native(LOGPROB, result.logprobs)
                         + self.logprobs[at:])
        spanning = protocol.native(TOKEN, result.token_versions) if result.token_versions else b""
        self.versions = (self.versions[:at] + _repeated(result.version, added)
                         + (spanning or _repeated(result.version, gen)) + self.versions[at:])
        mask = self.mask if self.mask is not None else b"\x01" * total
        self.mask = mask[:b] + b"\x00" * added + b"\x01" * gen + mask[b:]
        offsets = array.array(OFFSET, self.offsets)
        for k in range(member + 1, self.n + 1):
            offsets[k] += added + gen
        self.offsets = offsets.tobytes()
        start = b - a + added
        turn = Turn(result.version, TurnSampling(start, sampling.temperature, sampling.top_p, sampling.top_k))
        if self.later is None:
            self.later = {}
        self.later.setdefault(member, []).append(turn)
        self.finish_reasons = _replaced(self.finish_reasons, member, (result.finish_reasons or [""])[0])
        self.served_by = _replaced(self.served_by, member, worker)

    def sequence(self, member: int) -> tuple[list[int], int]:
        """The member's prompt and output ids, one list, and where its output begins (what a teacher scores)."""
        prompt = _ids(self.prompt)
        a, b = self.span(member)
        return prompt.tolist() + _ids(self.tokens)[a:b].tolist(), len(prompt)

    def record_teacher(self, logprobs: Sequence[Sequence[float]],
                       top: Sequence[tuple[bytes, bytes]] | None = None, top_k: int = 0) -> None:
        """Every member's teacher logprobs (one per output id, member order), one column
        beside the sampler's; with `top` (per member, its packed top-k ids and logprobs as the
        reply carried them, `top_k` per output id), those beside them."""
        if len(logprobs) != self.n or (top is not None and len(top) != self.n):
            raise ValueError(f"group {self.key}: teacher logprobs for {len(logprobs)} of its {self.n} members")
        for j, lps in enumerate(logprobs):
            a, b = self.span(j)
            if len(lps) != b - a:
                raise ValueError(f"{self.key.sample(j)}: {len(lps)} teacher logprobs for {b - a} output ids")
            if top is not None and not (len(top[j][0]) // _ITEM[TOKEN] == len(top[j][1]) // _ITEM[LOGPROB]
                                        == top_k * (b - a)):
                raise ValueError(f"{self.key.sample(j)}: the teacher's top-{top_k} arrays hold "
                                 f"{len(top[j][0]) // _ITEM[TOKEN]} ids and {len(top[j][1]) // _ITEM[LOGPROB]} "
                                 f"logprobs for {b - a} output ids")
        self.teacher_logprobs = b"".join(array.array(LOGPROB, lps).tobytes() for lps in logprobs)
        if top is not None:
            self.teacher_top_ids = b"".join(protocol.native(TOKEN, ids) for ids, _ in top)
            self.teacher_top_logprobs = b"".join(protocol.native(LOGPROB, lps) for _, lps in top)

    def annotate(self, member: int, text: str, messages: list[dict] | None) -> None:
        if self.texts is None:
            self.texts = [""] * self.n
        self.texts[member] = text
        if messages is not None:
            if self.messages is None:
                self.messages = [None] * self.n
            self.messages[member] = tuple(MappingProxyType(dict(m)) for m in messages)

    def context(self, member: int, appended_ids: Sequence[int]) -> list[int]:
        """The ids a later turn of `member` is generated from: the prompt, its output so
        far, then `appended_ids`."""
        a, b = self.span(member)
        return _ids(self.prompt).tolist() + _ids(self.tokens)[a:b].tolist() + list(appended_ids)

    def train_group(self) -> protocol.TrainGroup:
        """What the trainer is sent of the group (one trainable record: outputs and advantages set)."""
        assert self.advantages is not None
        turns = ([protocol.MemberTurn(j, t.sampling.start, t.sampling.temperature, t.sampling.top_p, t.sampling.top_k)
                  for j, later in sorted(self.later.items()) for t in later] if self.later else [])
        s = self.sampling
        return protocol.TrainGroup(
            self.key, protocol.native(TOKEN, self.prompt), self.lengths(),
            protocol.native(TOKEN, self.tokens), protocol.native(LOGPROB, self.logprobs), self.advantages_list(),
            self.oldest(), s.temperature, s.top_p, s.top_k, self.mask or b"", turns,
            protocol.native(LOGPROB, self.teacher_logprobs) if self.teacher_logprobs is not None else b"",
            protocol.native(TOKEN, self.teacher_top_ids), protocol.native(LOGPROB, self.teacher_top_logprobs))


class SampleView(msgspec.Struct, frozen=True, gc=False):
    """A sample as user code sees it: member `member` of a group, read-only and current (a
    later turn shows through), each property O(1): token ids, logprobs, mask and token
    versions are read-only memoryviews of the store's buffers (`.tolist()` for lists). It
    changes only through the episode context."""

    _record: GroupRecord
    member: int

    @property
    def key(self) -> GroupKey:
        """Its group's key."""
        return self._record.key

    @property
    def sample_id(self) -> str:
        """Its name, for people (log lines, `flexmarl samples`)."""
        return self._record.key.sample(self.member)

    @property
    def agent(self) -> str:
        return self._record.key.agent

    @property
    def batch(self) -> int:
        """The global batch (iteration) its episode belongs to."""
        return self._record.batch

    @property
    def text(self) -> str:
        """The last turn's generated text (agents with a tokenizer)."""
        texts = self._record.texts
        return texts[self.member] if texts is not None else ""

    @property
    def reward(self) -> float | None:
        return self._record.reward(self.member)

    @property
    def status(self) -> str:
        """pending until its group is ready, then consumed, or dropped."""
        return self._record.status

    @property
    def finish_reason(self) -> str:
        reasons = self._record.finish_reasons
        return reasons[self.member] if reasons else ""

    @property
    def prompt_ids(self) -> memoryview:
        return _ids(self._record.prompt)

    @property
    def output_ids(self) -> memoryview:
        """Every turn's generated ids and the ids appended between turns, in order (empty
        until its first turn came back)."""
        r = self._record
        offsets = r.offsets  # `span`, inline: read per sample by most workflows
        if not offsets:
            return _ids(b"")
        a, b = _SPAN.unpack_from(offsets, 8 * self.member)
        return memoryview(r.tokens).cast("i")[a:b]  # TOKEN

    @property
    def logprobs(self) -> memoryview[float]:
        """The sampler's logprob of each output id (0.0 for appended ids)."""
        a, b = self._record.span(self.member)
        return _floats(self._record.logprobs)[a:b]

    @property
    def mask(self) -> memoryview:
        """Per output id: 1 generated, 0 appended."""
        r = self._record
        a, b = r.span(self.member)
        return memoryview(r.mask).cast("b")[a:b] if r.mask is not None else _ones(b - a)

    @property
    def token_versions(self) -> memoryview:
        """Per output id: the policy version that produced it (appended ids: their turn's)."""
        a, b = self._record.span(self.member)
        return _ids(self._record.versions)[a:b]

    @property
    def versions(self) -> list[int]:
        """The policy version of every turn."""
        return self._record.turn_versions(self.member)

    @property
    def last_turn(self) -> tuple[memoryview, memoryview[float]]:
        """The ids and sampler's logprobs the last turn generated."""
        r = self._record
        a, b = r.span(self.member)
        start = a + r.turns_of(self.member)[-1].start
        return _ids(r.tokens)[start:b], _floats(r.logprobs)[start:b]

    @property
    def messages(self) -> tuple | None:
        """The conversation so far (samples made by ctx.chat), read-only mappings."""
        messages = self._record.messages
        return messages[self.member] if messages is not None else None

    def __repr__(self) -> str:
        return f"SampleView({self.sample_id!r}, text={self.text!r}, reward={self.reward})"


def _packed(ids: Sequence[int]) -> bytes:
    return ids.tobytes() if type(ids) is array.array and ids.typecode == TOKEN else array.array(TOKEN, ids).tobytes()


def _ids(data: bytes) -> memoryview:
    return memoryview(data).cast("i")  # TOKEN


def _floats(data: bytes) -> memoryview[float]:
    return memoryview(data).cast("f")  # LOGPROB


def _repeated(version: int, count: int) -> bytes:
    return _TOKEN.pack(version) * count


# Tuples of one string repeated, made once and shared by every group that has one (most
# groups' instances and finish reasons): no new object per group.
_REPEATS: dict[tuple[str, int], tuple[str, ...]] = {}


def _repeat(value: str, n: int) -> tuple[str, ...]:
    repeated = _REPEATS.get((value, n))
    if repeated is None:
        if len(_REPEATS) >= 65536:  # bounded: instance names come and go in a long run
            _REPEATS.clear()
        repeated = _REPEATS[(value, n)] = (value,) * n
    return repeated


def _same(values: Sequence[str], n: int) -> tuple[str, ...]:
    """`values` (n of them; none: n empty ones) as a tuple, a shared one where they are all equal."""
    if not values:
        return _repeat("", n)
    first = values[0]
    return _repeat(first, n) if values.count(first) == n else tuple(values)


def _replaced(values: tuple[str, ...], member: int, value: str) -> tuple[str, ...]:
    return (*values[:member], value, *values[member + 1:])


_TOKEN, _REWARD = struct.Struct(TOKEN), struct.Struct(REWARD)
_NOT_YET, _NAN = _TOKEN.pack(NOT_YET), _REWARD.pack(math.nan)


_ONES = b"\x01" * 4096


def _ones(n: int) -> memoryview:
    """A read-only mask of n ones (every id generated)."""
    global _ONES
    if n > len(_ONES):
        _ONES = b"\x01" * (2 * n)
    return memoryview(_ONES).cast("b")[:n]
