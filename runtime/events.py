"""Event types of the run's event log: every state transition the controller acts on, declared once.

Each event is a msgspec Struct in one tagged union: encoded, the ``event`` field holds the
class name, so a decoder picks the type from the body alone. Every event carries ``seq``
(0, 1, 2, ... in log order) and ``t`` (monotonic seconds since the run started); the log
writer stamps both, so code that emits an event never sets them.

To add an event type, declare another subclass of ``Event`` below: ``EVENT_TYPES`` collects
every subclass, and readers skip types they do not know. Adding fields with defaults to an
existing type is compatible too. Anything a reader of the current ``FORMAT_VERSION`` would
misread (renaming or retyping a field, changing the framing) bumps ``FORMAT_VERSION``.

This module knows nothing about files, the controller or workers: it is plain data.
"""

from __future__ import annotations

from typing import Iterator, Union

import msgspec

from .keys import SCORE_TURN, GroupKey

# Version of the log format (framing and event schemas). Readers refuse newer logs.
# 2: a group's samples are named by the group and its members' count (`n`, `parts`), not
# listed one by one; readers still read format 1.
# 3: a frame holds the events of one write as a msgpack array (formats 1 and 2: one event a
# frame); readers still read formats 1 and 2.
# 4: groups, samples and later turns are named by typed keys (runtime/keys.py: a group's
# key, its members by index, a turn by its number), never by strings; micro-batches and
# drops name parts of groups. Readers read formats 1 to 3 as format 4
# (runtime/legacy_events.py), the frozen agents' GroupServed and the teachers'
# TeacherScored of format 3 among them.
FORMAT_VERSION = 4


# gc=False: events hold plain data and never take part in a reference cycle, so the
# collector need not track the thousands a second a large run makes.
class Event(msgspec.Struct, tag_field="event", tag=True, kw_only=True, omit_defaults=True, gc=False):
    """Base of every event. ``seq`` and ``t`` are keyword-only and set by the log writer."""

    seq: int = -1
    t: float = 0.0


# ---------------------------------------------------------------- run and workers


class RunStarted(Event):
    config_toml: str  # the resolved config, so a log is self-describing
    agents: list[str]
    mode: str  # "sync" | "async"
    max_staleness: int
    seed: int


class WorkerJoined(Event):
    worker: str
    role: str  # "rollout" | "trainer"
    host: str
    pid: int


class WorkerDied(Event):
    worker: str
    why: str


class WorkerRestarted(Event):
    # The launcher started a worker again after its process exited (or its Ray actor or
    # node was lost); the new process registers under the same id (a WorkerJoined follows).
    worker: str
    role: str
    exit_code: int | None  # of the process that exited (negative: killed by that signal); None: lost with its Ray actor
    restarts: int  # restarts of this worker so far, this one included
    pid: int  # the new process; 0 where not known yet (a Ray actor still being placed: see its WorkerJoined)
    # How the one it replaces ended, as its launcher saw it ("its Ray actor ... was lost with its
    # node"): known only now where the controller lost the worker first (its WorkerDied says "connection lost").
    why: str = ""


class RunFinished(Event):
    steps: int
    wall_s: float


class RunResumed(Event):
    # The controller restarted from the checkpoint of `step`: everything logged before this
    # for batches after `step` was undone (those batches are generated and trained again).
    step: int
    checkpoint: str
    config_toml: str


class EventsLost(Event):
    # Damaged bytes of the log held events `first_seq` to `next_seq` - 1 (next_seq -1: the
    # log ended there, before the checkpoint a resume started from, so how many followed is
    # not known). Written by the resume that found them (before its RunResumed), or made up
    # by the reader where damage was never recorded (at `first_seq`, then). Replay leaves
    # out the batches whose events the damage split (`batches`, filled by replay's lineage).
    segment: str  # the file holding the damage
    offset: int  # the byte offset where it begins
    nbytes: int  # how many bytes it spans
    first_seq: int
    next_seq: int
    why: str
    batches: list[int] = []


class CheckpointWritten(Event):
    # A consistent cut of the run after `step` optimizer steps is complete on disk.
    step: int
    path: str
    nbytes: int
    seconds: float


class BatchStarted(Event):
    # The first episode of a global batch starts; with a dataset, where the run is in it.
    batch: int
    first_episode: int  # episodes are numbered over the whole run: batch b starts at (b - 1) x queries
    data_epoch: int = -1  # -1: no dataset
    data_rows: list[int] = []  # the dataset row of each episode of the batch, in order


class EpisodeAdmitted(Event):
    # Continuous admission (pipeline.admission): the first turn of episode `episode`, started
    # as one of batch `started`'s, was admitted while its agent's version allowed batches up
    # to `newest` (the last batch that may train it within the staleness bound).
    episode: str
    started: int
    newest: int
    # Capacity admission: how many of its agent's instances had drained (no group left on
    # them) when it was admitted, which bounds the spares it could count on
    # (`decisions.spare_room`); -1 under continuous admission (every spare).
    drained: int = -1


class EpisodeAssigned(Event):
    # Continuous admission (pipeline.admission): episode `episode`, started as one of batch
    # `started`'s, ended; global batch `batch` trains its groups (the earliest batch with
    # fewer than queries_per_step episodes ended: a later one than `started` when it
    # carried over, an earlier one when it ended before a slower episode of that batch).
    episode: str
    started: int
    batch: int


class EpisodeAbandoned(Event):
    # Continuous admission (pipeline.admission): episode `episode`, started as one of batch
    # `started`'s and admitted while its version allowed batches up to `newest`, was still
    # running when every batch up to `newest` had its episodes ended: no batch could train
    # it, so it was abandoned (its requests aborted, its groups dropped, its slot freed).
    episode: str
    started: int
    newest: int


class GroupTargets(Event):
    # Dynamic sampling: batch `batch`'s regular episodes ended; each dynamic-sampling agent
    # trains this many groups of it (those they opened), groups beyond them are surplus.
    batch: int
    targets: dict[str, int]


class EpisodesDrawn(Event):
    # Dynamic sampling: `episodes` extra episodes of batch `batch` start, for the groups
    # each agent is `missing` (dropped because their rewards were all equal).
    batch: int
    episodes: int
    missing: dict[str, int]


class EvaluationDone(Event):
    # Held-out episodes at the weights after `step` optimizer steps; nothing of them trains.
    step: int
    episodes: int
    failed: int
    rewards: dict[str, float]  # agent -> mean reward over its eval samples


# ---------------------------------------------------------------- rollout


# What RequestsCompleted counts of its samples' prompts (for prefix-cache hit rates).
PROMPT_FIELDS = ("prompt_tokens", "cached_tokens", "turn_prompt_tokens", "turn_cached_tokens")


class Parts(msgspec.Struct, array_like=True, gc=False):
    """Groups, or contiguous parts of them, named compactly: part i is members `firsts[i]`
    to `firsts[i] + sizes[i] - 1` of the group `keys[i]`, at turn `turns[i]` (no `turns`:
    every part a first turn). A later turn (turn k >= 1) is member `firsts[i]` alone."""

    keys: list[GroupKey] = []
    firsts: list[int] = []
    sizes: list[int] = []
    turns: list[int] = []

    def __iter__(self) -> Iterator[tuple[GroupKey, int, int, int]]:
        """(key, first, size, turn) of each part."""
        turns = self.turns or (0,) * len(self.keys)
        return zip(self.keys, self.firsts, self.sizes, turns)

    def samples(self) -> list[tuple[GroupKey, int]]:
        """The members of the parts that are first turns, as (group key, member), in order."""
        return [(key, j) for key, first, size, turn in self if not turn for j in range(first, first + size)]

    @property
    def count(self) -> int:
        """The samples the parts hold (a later turn: its one sample)."""
        return sum(self.sizes)

    def __repr__(self) -> str:  # for people: replay's check prints the decisions that differ
        return f"Parts({', '.join(_named(*part) for part in self)})"


def _named(key: GroupKey, first: int, size: int, turn: int) -> str:
    if turn == SCORE_TURN:
        return f"{key}/{first}@teacher"
    if turn:
        return f"{key}/{first}@{turn}"
    return f"{key}/{first}" if size == 1 else f"{key}/{first}..{first + size - 1}"


def whole(groups: list[tuple[GroupKey, int]]) -> Parts:
    """Whole groups, (key, size) each, as parts."""
    return Parts([key for key, _ in groups], [0] * len(groups), [size for _, size in groups])


class RequestsDispatched(Event):
    # One GENERATE message's groups of one agent, sent to a rollout instance (the router's decision).
    worker: str
    agent: str
    request_id: int
    tokens: int  # prompt tokens sent
    parts: Parts = msgspec.field(default_factory=Parts)


class RequestsCompleted(Event):
    # A GENERATED reply's groups of one agent: these samples got outputs.
    worker: str
    agent: str
    request_id: int
    versions: list[int]  # per part: the policy version that generated it
    tokens: int  # output tokens received
    # Prompt tokens of these samples' requests (each sample counting its prompt) and how
    # many of them the engine found in its prefix cache (vLLM's count; a group's first
    # sample counted as finding none), for first turns and for later turns of a conversation.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    turn_prompt_tokens: int = 0
    turn_cached_tokens: int = 0
    parts: Parts = msgspec.field(default_factory=Parts)
    # Per part, where a load let its request continue under new weights so its tokens span
    # versions: per member, the oldest version of its tokens (staleness.UNSPANNED for a member
    # whose tokens are all the part's version); [] for a part whose tokens do not span, and
    # no list at all when no part's do.
    oldest: list[list[int]] = []

    def prompt_counts(self) -> tuple[int, int, int, int]:
        """The PROMPT_FIELDS, in order."""
        return self.prompt_tokens, self.cached_tokens, self.turn_prompt_tokens, self.turn_cached_tokens


class GroupOpened(Event):
    # The n samples of one prompt, members 0 .. n-1 of the group `key`, exist from here on
    # (this is what "generated" counts).
    key: GroupKey
    # The global batch (iteration) that started it; stored under its first name, "tag".
    batch: int = msgspec.field(name="tag")
    n: int = 0

    @property
    def agent(self) -> str:
        return self.key.agent


class GroupComplete(Event):
    # Every member has output and reward: the group is trainable.
    key: GroupKey
    rewards: list[float]
    tokens: int = 0  # its prompt once plus every output: its size under a token budget

    @property
    def agent(self) -> str:
        return self.key.agent


class SamplesDropped(Event):
    # Samples that will never train (too stale, failed, abandoned at shutdown): whole groups
    # as the controller drops them.
    agent: str
    parts: Parts
    why: str


class TeacherScored(Event):
    # On-policy distillation: every member of the distilled agent's group (of batch
    # `batch`) was scored by `teacher` (a prefill of its sequence), member j by the
    # teacher's policy version `versions[j]`.
    key: GroupKey
    batch: int
    teacher: str
    versions: list[int]

    @property
    def agent(self) -> str:
        return self.key.agent


class GroupServed(Event):
    # A frozen agent's group (members 0 .. n-1 of the group `key`) once its episode ended
    # well: generated, never to be trained; the rewards the workflow gave it, if any, in order.
    key: GroupKey
    n: int
    rewards: list[float] = []

    @property
    def agent(self) -> str:
        return self.key.agent


# ---------------------------------------------------------------- training


class MicroBatchFormed(Event):
    # The pipeline's decision: these samples (whole groups, as the controller forms them)
    # train `agent` into policy `version`.
    agent: str
    trainer: str
    version: int  # the version the optimizer step after this micro-batch produces
    parts: Parts
    min_versions: list[int]  # per sample of `parts`, in order: the oldest policy version in any of its turns


class MicroBatchTrained(Event):
    # A trainer finished forward/backward of one micro-batch; ``t`` is when it finished.
    agent: str
    trainer: str
    version: int
    n: int  # samples in the micro-batch
    seconds: float  # trainer-side duration


class OptimizerStep(Event):
    agent: str
    trainer: str
    version: int  # the version the step produced
    samples: int


class StepSkipped(Event):
    # The step to `version` had a non-finite gradient: the trainer left the weights and
    # optimizer state as they were (the version advanced with the last weights).
    agent: str
    trainer: str
    version: int
    grad_norm: float
    in_a_row: int  # consecutive skipped steps of this agent, this one included


class TrainingRestored(Event):
    # The agent's trainer died with its state: it is restored at `version` (its last saved
    # state) and every batch from there to `batch` is trained again. What was trained into
    # versions after `version` before this no longer counts.
    agent: str
    version: int
    batch: int
    why: str


class WeightSyncStarted(Event):
    agent: str
    version: int
    targets: list[str]  # rollout workers that load the new weights
    transport: str = ""  # the parameter channel's transport chosen for them


class WeightSyncFinished(Event):
    agent: str
    version: int
    seconds: float
    nbytes: int


class SnapshotRefreshed(Event):
    # A snapshot agent's instances now hold its source's weights of `version` (their
    # WeightSyncStarted / Finished, under the snapshot's name, precede this).
    agent: str
    source: str
    version: int


class AllocationChanged(Event):
    # Which workers serve `agent` from now on (the router's or allocator's decision).
    kind: str  # "rollout" | "trainer"
    agent: str
    workers: list[str]
    why: str
    # A trainer swap: "out" (parked), "in" (loaded from a copy a trainer parked); "" otherwise.
    swap: str = ""
    seconds: float = 0.0  # what the move took
    waited_s: float = 0.0  # of a swap-in: the seconds ready work of the agent waited on it


class DemandObserved(Event):
    # One input of the level 1 balancer: every agent's rollout demand at one observation.
    now: float  # the controller's monotonic clock, as the balancer was given it
    move_cost_s: float  # what the balancer assumed a move costs at this observation
    outstanding: dict[str, dict[str, float]]  # agent -> instance -> tokens queued or in flight
    dispatched_tokens: dict[str, float]  # agent -> tokens ever dispatched
    busy_s: dict[str, dict[str, float]]  # agent -> instance -> cumulative busy seconds


class RebalanceDecided(Event):
    # The level 1 balancer's decision: move `instances` from agent `src` to agent `dst`.
    instances: list[str]
    src: str
    dst: str
    why: str


class PlacementMeasured(Event):
    # The input of the placement by measured demand, once after a run's first batch
    # (`router.measured_placement`): every unit's instances and the tokens it was sent.
    # The moves it made follow as RebalanceDecided events.
    step: int  # the batch whose rollout it measured
    outstanding: dict[str, dict[str, float]]  # unit -> instance -> tokens queued or in flight
    dispatched_tokens: dict[str, float]  # unit -> tokens sent so far
    busy: dict[str, float] = msgspec.field(default_factory=dict)  # unit -> its instances' mean busy share so far


# Every event type, in declaration order; a new subclass above is picked up here.
EVENT_TYPES: tuple[type[Event], ...] = tuple(Event.__subclasses__())
EVENT_NAMES: frozenset[str] = frozenset(cls.__name__ for cls in EVENT_TYPES)
AnyEvent = Union[EVENT_TYPES]  # type: ignore[valid-type]

def without_stamp(event: Event) -> dict:
    """The event as a dict without ``seq`` and ``t``: what two runs of the same decision
    code must agree on (times and positions in the log differ between runs)."""
    fields = msgspec.structs.asdict(event)
    del fields["seq"], fields["t"]
    return {"event": type(event).__name__, **fields}
