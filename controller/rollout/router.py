"""Rollout routing: which instance generates which group.

Two parts, kept apart on purpose:
- decision functions (`route_group` over the `ROUTING_POLICIES` table, `split_sizes`,
  `stays`), plain Python over plain numbers, unit-tested and driven by the simulator
  without sockets;
- `RolloutClient`, the asyncio side: a group (n samples of one prompt) is one call, one
  future. Every group queued in one event-loop turn is routed then, whole to one instance
  (split into contiguous parts only when larger than an instance's fair share of the
  agent's work, and never into parts under `min_part` samples); a later turn of a sample
  goes back to the instance that generated its previous turn (its prefix cache holds the
  conversation) while that instance still serves the agent and its load is within
  `affinity_bound` of the alternative's. A whole group joins the instance its agent's
  group before it took in the same turn while that instance is at most `coalesce_tokens`
  more loaded than the rule's pick (small groups share a message: a message costs the
  controller and the engine alike, a few tokens each cost little). Everything bound for
  one instance in that turn goes in one GENERATE message, of any agent the instance
  serves. Replies come back per group, whole; a group resolves when its last part has. If an instance dies or fails a
  message, its unfinished parts are routed again (to another instance, since a dead one
  has left every agent); the experience store refuses a second result for a sample, so a
  re-issue can never add a sample twice. A call cancelled (its episode abandoned) aborts
  its parts on their instances (AbortGroups): each comes back once, as aborted or as its
  result, and is never routed again.

Routing is O(1) per group: the live instances of an agent are the instances' owner's list
(state/instances.py keeps it by join, death and leave events), the least loaded of two drawn at
random takes a group (every instance when there are two), and only a group large enough to
be split looks at them all. The owner counts the work outstanding on each instance; the
client reports it. An adapter agent's instances are every instance of its base, so its
load is counted with its base's other agents' on each.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Sequence

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey, TurnKey
from flexmarl.runtime.staleness import spanned_oldest

from ..control.interfaces import Emit
from ..control.server import ControllerServer, RemoteError, WorkerDied
from ..state.failures import RunFailed
from ..state.groups import GroupOutput, assemble
from ..state.instances import RolloutInstances

log = logging.getLogger("flexmarl.router")

# A group is split over instances only into parts of at least this many samples: each part
# prefills the prompt once more, and small groups cost an engine about as much as one sample.
MIN_PART = 16
# A later turn stays on the instance of the turn before while that instance's outstanding
# work is at most this many times the alternative's (plus the turn's own cost).
AFFINITY_BOUND = 2.0
# A group joins the instance its agent's group before it took in the same routing turn (one
# GENERATE message for both) while that instance's outstanding work is at most this many
# tokens over the rule's own pick's: small groups (a few tokens each) share a message, a
# group of real size (prompt and max_tokens of every member) never does.
COALESCE_TOKENS = 256.0

Load = Callable[[str], float]


def _least_loaded(instances: Sequence[str], load: Load, turn: int, rng: random.Random) -> str:
    """The less loaded of two instances drawn at random (of both, when there are two)."""
    n = len(instances)
    if n <= 2:
        return min(instances, key=load)  # ties: the first in routing order
    # Two distinct positions, each uniform: int(random() * n) is one call where randrange(n)
    # is four (its bias, n / 2**53, is nothing at any number of instances).
    a = int(rng.random() * n)
    b = int(rng.random() * (n - 1))
    b += b >= a
    if b < a:  # ties: the first in routing order
        a, b = b, a
    return instances[b] if load(instances[b]) < load(instances[a]) else instances[a]


def _round_robin(instances: Sequence[str], load: Load, turn: int, rng: random.Random) -> str:
    return instances[turn % len(instances)]


# Level 2 policies (`router.within_agent`): least outstanding work, and the static baseline.
ROUTING_POLICIES: dict[str, Callable[[Sequence[str], Load, int, random.Random], str]] = {
    "least_loaded": _least_loaded,
    "round_robin": _round_robin,
}


def route_group(policy: str, instances: Sequence[str], load: Load, turn: int, rng: random.Random) -> str:
    """The instance a group (or one part of it) goes to: `instances` are the agent's live
    ones in routing order, `load(w)` the work outstanding on w, `turn` counts the agent's
    earlier groups (round robin uses it). The live client and the simulator route here."""
    if not instances:
        raise ValueError("no instance to route to")
    return _rule(policy)(instances, load, turn, rng)


def _rule(policy: str) -> Callable[[Sequence[str], Load, int, random.Random], str]:
    try:
        return ROUTING_POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown routing policy {policy!r} (known: {', '.join(ROUTING_POLICIES)})") from None


def split_sizes(n: int, cost: float, share: float, instances: int, min_part: int = MIN_PART) -> list[int]:
    """The sizes of the contiguous parts a group of `n` samples (costing `cost` tokens in
    all) is cut into: [n], whole, unless it is larger than an instance's fair `share` of
    the agent's work, and then as few parts as bring each within it, none under
    `min_part` samples, at most one per instance."""
    if instances < 2 or n < 2 * min_part or cost <= share:
        return [n]
    parts = min(instances, n // min_part, math.ceil(cost / max(share, 1e-9)))
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def coalesces(taken_load: float, chosen_load: float, slack: float = COALESCE_TOKENS) -> bool:
    """Whether a new group goes to the instance its agent's previous group of the same
    routing turn took (load `taken_load`, the group before counted) rather than to the
    rule's choice (load `chosen_load`): one message for both, within `slack` tokens."""
    return slack > 0 and taken_load <= chosen_load + slack


def stays(previous_load: float, other_load: float, cost: float, bound: float = AFFINITY_BOUND) -> bool:
    """Whether a later turn goes back to the instance of its previous turn (load
    `previous_load`) rather than to the routing policy's choice (load `other_load`)."""
    return previous_load <= bound * other_load + cost


class NoInstance(RunFailed):
    """No live rollout instance serves the agent, and none is on its way back: the run
    stops (it is not the episode's failure)."""


class RequestRefused(Exception):
    """The engine refused one group (empty, too long for the model, ids outside the
    vocabulary, settings it rejects); only that group's episode fails."""


class RequestsFailed(Exception):
    """Requests failed (or lost their instance) on `max_attempts` instances in a row."""


@dataclass(slots=True)
class _Group:
    """One generate call: the parts of its group that came back, one future."""

    agent: str
    future: asyncio.Future
    left: int = 0
    parts: list = field(default_factory=list)  # (GroupResult, worker)
    sent: list = field(default_factory=list)  # its parts as sent, each to its `worker`, while unanswered


class _Part:
    """A group, or a contiguous part of one, on its way to an instance."""

    __slots__ = ("group", "owner", "after", "attempt", "worker", "cost")

    def __init__(self, group: protocol.GenGroup, owner: _Group, after: str, attempt: int = 1) -> None:
        self.group = group
        self.owner = owner
        self.after = after  # the instance of the sample's previous turn ("": a first turn)
        self.attempt = attempt
        self.worker = ""  # the instance it was last sent to
        # The tokens it may cost its engine: each member's prompt and max_tokens.
        self.cost = group.n * (len(group.prompt_ids) + group.max_tokens)


@dataclass
class RoutingPolicy:
    """How a group picks among its agent's instances: the rule (`route_group`) with its
    round-robin position per agent and its random draws, the smallest part a group is
    split into, how much more loaded a later turn's previous instance may be and still
    take the turn (`stays`), and how many tokens more loaded the instance an agent's group
    took in this routing turn may be and still take the next whole group (`coalesces`;
    the least-loaded rule only: round robin is the static baseline)."""

    within_agent: str
    min_part: int
    affinity_bound: float
    rng: random.Random
    coalesce_tokens: float = COALESCE_TOKENS
    turn: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    rule: Callable[[Sequence[str], Load, int, random.Random], str] = field(init=False)
    # Per agent, the instance its last whole group took in this routing turn (`new_turn` forgets).
    taken: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rule = _rule(self.within_agent)  # an unknown name fails here, not at the first group
        if self.within_agent != "least_loaded":
            self.coalesce_tokens = 0.0

    def new_turn(self) -> None:
        """A routing turn begins: no group of it was routed yet."""
        if self.taken:
            self.taken.clear()

    def choose_whole(self, agent: str, instances: Sequence[str], load: Load) -> str:
        """`choose` for a whole first-turn group: the instance the agent's group before it
        took in this routing turn where that one `coalesces`, else the rule's pick."""
        worker = self.choose(agent, instances, load)
        if self.coalesce_tokens > 0:
            taken = self.taken.get(agent)
            if taken is not None and taken != worker and coalesces(load(taken), load(worker), self.coalesce_tokens):
                worker = taken
            self.taken[agent] = worker
        return worker

    def sizes(self, n: int, cost: float, instances: Sequence[str], load: Load) -> list[int]:
        """The parts a new group of n samples is cut into (`split_sizes`): [n] unless it can split."""
        if n < 2 * self.min_part or len(instances) < 2:
            return [n]
        share = (sum(load(w) for w in instances) + cost) / len(instances)
        return split_sizes(n, cost, share, len(instances), self.min_part)

    def choose(self, agent: str, instances: Sequence[str], load: Load) -> str:
        """The instance the rule picks (`route_group`, `instances` not empty) for the agent's next group or part."""
        turn = self.turn[agent]
        self.turn[agent] = turn + 1
        return self.rule(instances, load, turn, self.rng)

    def keeps_turn(self, previous: str, chosen: str, load: Load, cost: float) -> bool:
        """Whether a later turn goes back to `previous` (still serving its agent) rather than `chosen`."""
        return self.affinity_bound > 0 and stays(load(previous), load(chosen), cost, self.affinity_bound)


class RolloutClient:
    def __init__(self, server: ControllerServer, instances: RolloutInstances, *, instance_wait_s: float = 60.0,
                 emit: Emit | None = None, within_agent: str = "least_loaded",
                 version_of: Callable[[str], int] | None = None, min_part: int = MIN_PART,
                 affinity_bound: float = AFFINITY_BOUND, seed: int = 0, coalesce_tokens: float = COALESCE_TOKENS,
                 instance_expected: Callable[[], bool] = lambda: False) -> None:
        self.server = server
        # The agent's synced version, sent with each group: an adapter agent's group runs
        # under its adapter at that version (or a newer one the instance already holds).
        self.version_of = version_of or (lambda agent: -1)
        self.emit = emit or (lambda event: None)
        self.owner = instances  # which instances serve an agent; outstanding work per instance
        # A request waits this long for an instance of its agent, and for as long as
        # `instance_expected()` says one is on its way back (a worker being restarted).
        self.instance_wait_s = instance_wait_s
        self.instance_expected = instance_expected
        self.max_attempts = 3  # a part that fails on this many instances fails its episode
        self.policy = RoutingPolicy(within_agent, min_part, affinity_bound, random.Random(seed), coalesce_tokens)
        self.dispatched_tokens: dict[str, float] = defaultdict(float)  # per agent, for demand
        self._queued: list[_Part] = []
        self._flush_scheduled = False
        self._waiting: dict[str, list[_Part]] = {}  # agent -> parts waiting for an instance to serve it
        self._dispatching: set[asyncio.Task] = set()  # messages being sent, waits for an instance
        self.closed = False  # the run is over: nothing is routed or re-issued
        self.reissued = 0  # samples
        self.refused = 0  # groups
        self.aborted = 0  # group parts aborted on their instances (their episodes abandoned)
        self.affinity = {"kept": 0, "moved": 0}  # later turns: on their previous instance, or not
        # Per agent, so far: prompt tokens of the samples generated and how many the engines
        # found in their prefix cache, for first turns and later turns (ev.PROMPT_FIELDS).
        self.prompt_counts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(ev.PROMPT_FIELDS, 0))

    @property
    def outstanding(self) -> dict[str, float]:
        return self.owner.outstanding

    def instances(self, agent: str) -> list[str]:
        return self.owner.instances(agent)

    async def generate(self, agent: str, group: protocol.GenGroup, after: str = "") -> GroupOutput:
        """The group's output, every member in order; `after`: the instance that generated
        the sample's previous turn (a later turn goes back to it if it can)."""
        loop = self.server.loop()
        owner = _Group(agent, loop.create_future())
        part = _Part(group, owner, after)
        self.dispatched_tokens[agent] += part.cost
        self._queued.append(part)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        try:
            return await owner.future
        except asyncio.CancelledError:  # its episode was abandoned (or the run stops)
            self._abort(owner)
            raise

    def _abort(self, owner: _Group) -> None:
        """Nobody waits for the group any more: its parts on instances are aborted there
        (AbortGroups; each comes back once, as aborted, or as its result if it had finished,
        and its work is counted done then); one queued, waiting for an instance or to be
        routed again is skipped, its future being done."""
        if self.closed or self.server.closing:
            return
        by_worker: dict[str, list[protocol.GenGroup]] = {}
        for part in owner.sent:
            by_worker.setdefault(part.worker, []).append(part.group)
        owner.sent.clear()
        messages: list[tuple[str, protocol.Message]] = [
            (worker, protocol.AbortGroups(self.server.next_request_id(), [g.key for g in groups],
                                          [g.first for g in groups], [g.turn for g in groups]))
            for worker, groups in by_worker.items()]
        self.aborted += sum(len(groups) for groups in by_worker.values())
        sent = self.server.send_now(messages)
        if sent < len(messages):
            self._start(self._send_all(messages[sent:]))

    # ------------------------------------------------------------ routing, once per loop turn

    def _queue(self, parts: list[_Part]) -> None:
        self._queued += parts
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.server.loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        queued, self._queued = self._queued, []
        self.policy.new_turn()
        bound: dict[str, list[_Part]] = {}
        for part in queued:
            if part.owner.future.done():
                continue  # its group failed meanwhile (another part was refused)
            instances = self.owner.instances(part.owner.agent)
            if not instances:
                self._wait_for_instance(part)
                continue
            for piece, worker in self._route(part, instances):
                bound.setdefault(worker, []).append(piece)
        if bound:
            messages = [self._message(worker, parts) for worker, parts in bound.items()]
            # Sent here, in order, while the sockets take them (none waits); from the first
            # whose worker's queue is full on, by a task that waits its turn.
            sent = self.server.send_now(messages)
            if sent < len(messages):
                self._start(self._send_all(messages[sent:]))

    def _route(self, part: _Part, instances: list[str]) -> list[tuple[_Part, str]]:
        agent, load = part.owner.agent, self.owner.outstanding.__getitem__
        if part.owner.left == 0:  # a new group: parts are counted once
            pieces = _cut(part, self.policy.sizes(part.group.n, part.cost, instances, load))
            part.owner.left = len(pieces)
        else:  # a part routed again: as it was
            pieces = [part]
        routed = []
        # A new first-turn group, whole, may share its agent's instance of this turn; a part
        # of a split group, a later turn or a part routed again takes the rule's pick.
        whole = len(pieces) == 1 and not part.after and part.attempt == 1
        choose = self.policy.choose_whole if whole else self.policy.choose
        for piece in pieces:
            worker = choose(agent, instances, load)
            if (piece.after and piece.after != worker and self.owner.serving(piece.after, agent)
                    and self.policy.keeps_turn(piece.after, worker, load, piece.cost)):
                worker = piece.after
            if piece.after:
                self.affinity["kept" if worker == piece.after else "moved"] += 1
            self.owner.add_work(worker, piece.cost)  # counted now: the next group sees it
            routed.append((piece, worker))
        return routed

    def _wait_for_instance(self, part: _Part) -> None:
        agent = part.owner.agent
        if agent in self._waiting:
            self._waiting[agent].append(part)
            return
        self._waiting[agent] = [part]
        task = self._start(self._instance_for(agent))
        task.add_done_callback(lambda t: self._fail_waiting(agent, asyncio.CancelledError()) if t.cancelled() else None)

    def _start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._dispatching.add(task)
        task.add_done_callback(self._dispatching.discard)
        task.add_done_callback(_report_failure)
        return task

    async def close(self) -> None:
        """Ends every send and wait for an instance under way (the run is over: nothing is
        re-issued)."""
        self.closed = True
        for task in list(self._dispatching):
            task.cancel()
        await asyncio.gather(*self._dispatching, return_exceptions=True)

    async def _instance_for(self, agent: str) -> None:
        """Waits for an instance to serve `agent`, then routes its waiting parts; past
        `instance_wait_s` with none on its way back
        (`instance_expected`) they fail (NoInstance, the run's failure)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.instance_wait_s
        while not self.owner.instances(agent):
            if self.instance_expected():
                deadline = loop.time() + self.instance_wait_s
            elif loop.time() > deadline:
                break
            await asyncio.sleep(0.1)
        if self.owner.instances(agent):
            self._queue(self._waiting.pop(agent))
            return
        gone = [f"{w.worker_id} ({w.why_gone})" for w in self.server.registry.workers.values()
                if w.role == "rollout" and not w.alive]
        failure = NoInstance(f"the run stopped: no rollout instance could be made to serve agent {agent!r} "
                             f"for {self.instance_wait_s:g}s: none is being restarted or admitted"
                             + (f"; gone: {', '.join(gone)}" if gone else "")
                             + ". See the workers' logs in the run directory's logs/ folder")
        self._fail_waiting(agent, failure)

    def _fail_waiting(self, agent: str, failure: BaseException) -> None:
        for part in self._waiting.pop(agent, []):
            _fail(part.owner, failure)

    # ------------------------------------------------------------ messages

    def _message(self, worker: str, parts: list[_Part]) -> tuple[str, protocol.Generate]:
        waiting: dict[tuple[GroupKey, int, int], _Part] = {}
        groups = []
        versions: dict[str, int] = {}  # the agent's synced version, read once per message
        prompt_tokens = 0
        for part in parts:
            group, agent = part.group, part.owner.agent
            version = versions.get(agent)
            if version is None:
                version = versions[agent] = self.version_of(agent)
            group.version = version
            waiting[(group.key, group.first, group.turn)] = part
            part.worker = worker
            part.owner.sent.append(part)
            groups.append(group)
            prompt_tokens += len(group.prompt_ids)
        msg = protocol.Generate(self.server.next_request_id(), groups)
        if len(versions) == 1:  # one agent's groups (an instance serves one agent, most often)
            self.emit(ev.RequestsDispatched(worker, agent, msg.request_id, prompt_tokens, _parts(groups)))
        else:
            for agent, mine in _by_agent(parts).items():
                self.emit(ev.RequestsDispatched(worker, agent, msg.request_id,
                                                sum([len(p.group.prompt_ids) for p in mine]),
                                                _parts([p.group for p in mine])))
        # Bound with partial, not a lambda: a reply reaches `_replied` in one call.
        future = self.server.stream(worker, msg, functools.partial(self._replied, worker, waiting))
        future.add_done_callback(functools.partial(self._message_ended, worker, waiting))
        return worker, msg

    async def _send_all(self, messages: Sequence[tuple[str, protocol.Message]]) -> None:
        for worker, msg in messages:
            await self.server.send_request(worker, msg)

    def _replied(self, worker: str, waiting: dict[tuple[GroupKey, int, int], _Part], msg: protocol.Message,
                 buffers: list[Any]) -> bool:
        assert type(msg) is protocol.Generated
        done = []
        cost = 0
        for result in msg.results:
            part = waiting.pop((result.key, result.first, result.turn), None)
            if part is None:
                log.warning("%s returned an unknown or repeated group %s (from member %d, turn %d)", worker,
                            result.key, result.first, result.turn)
                continue
            cost += part.cost
            done.append((part, result))
            owner = part.owner
            _answered(part)
            owner.parts.append((result, worker))
            owner.left -= 1
            if owner.left == 0 and not owner.future.done():
                owner.future.set_result(assemble(owner.parts))
        if done:
            self.owner.work_done(worker, cost)  # the reply's parts' work, at once
            self._log_completed(worker, msg.request_id, done)
        for refusal in msg.refused:  # fails its episode alone; never re-issued (same model, same refusal)
            part = waiting.pop((refusal.key, refusal.first, refusal.turn), None)
            if part is None:
                log.warning("%s refused an unknown or repeated group %s (from member %d, turn %d)", worker,
                            refusal.key, refusal.first, refusal.turn)
                continue
            self.owner.work_done(worker, part.cost)
            _answered(part)
            if refusal.aborted:  # no one waits for it: its episode was abandoned
                continue
            self.refused += 1
            _fail(part.owner, RequestRefused(f"{part.owner.agent} on {worker} refused {_named(part.group)}: "
                                             f"{refusal.reason}"))
        return msg.done

    def _log_completed(self, worker: str, request_id: int, done: list[tuple[_Part, protocol.GroupResult]]) -> None:
        agent = done[0][0].owner.agent
        for p, _ in done:  # a loop, not any(): most replies carry a group or two
            if p.owner.agent != agent:
                break
        else:  # one agent's (an instance serves one agent, most often)
            self._log_agent_completed(worker, agent, request_id, done)
            return
        by_agent: dict[str, list[tuple[_Part, protocol.GroupResult]]] = {}
        for p, r in done:
            by_agent.setdefault(p.owner.agent, []).append((p, r))
        for agent, results in by_agent.items():
            self._log_agent_completed(worker, agent, request_id, results)

    def _log_agent_completed(self, worker: str, agent: str, request_id: int,
                             results: list[tuple[_Part, protocol.GroupResult]]) -> None:
        prompt, cached = [0, 0], [0, 0]  # first turns, later turns
        tokens, spanning = 0, False
        groups, versions = [], []
        for p, r in results:
            group = p.group
            groups.append(group)
            versions.append(r.version)
            later, n = group.turn > 0, group.n  # a later turn of a sample, not a group's first
            prompt[later] += n * len(group.prompt_ids)
            cached[later] += r.cached_tokens * (n - 1 if n > 1 else 1)
            tokens += sum(r.lengths)
            spanning = spanning or bool(r.token_versions)
        spans = [spanned_oldest(r.lengths, r.version, memoryview(protocol.native(protocol.TOKEN_TYPECODE,
                                                                                     r.token_versions)).cast("i"))
                 if r.token_versions else [] for _, r in results] if spanning else []
        event = ev.RequestsCompleted(
            worker, agent, request_id, versions, tokens,
            prompt[0], cached[0], prompt[1], cached[1], _parts(groups),
            spans if any(spans) else [])
        self.emit(event)
        counts = self.prompt_counts[agent]
        for name, value in zip(ev.PROMPT_FIELDS, event.prompt_counts()):
            counts[name] += value

    def _message_ended(self, worker: str, waiting: dict[tuple[GroupKey, int, int], _Part],
                       future: asyncio.Future) -> None:
        """The message's last reply came, or its instance died or failed it: what it left
        unfinished is routed again (the dead have left every agent), up to max_attempts."""
        if not waiting:
            return
        parts = list(waiting.values())
        waiting.clear()
        for part in parts:
            self.owner.work_done(worker, part.cost)
            _answered(part)
        # Read before anything else: a failure nobody reads is reported as never retrieved.
        exc = future.exception() if not future.cancelled() else asyncio.CancelledError()
        parts = [part for part in parts if not part.owner.future.done()]  # an aborted one: no one waits for it
        if not parts:
            return
        # Shutting down, the workers leave: nothing to re-issue.
        if not isinstance(exc, (WorkerDied, RemoteError)) or self.closed or self.server.closing:
            for part in parts:
                _fail(part.owner, exc or RuntimeError(f"{worker} ended a message with groups unanswered"))
            return
        again = []
        for part in parts:
            if part.attempt >= self.max_attempts:
                # A group that fails, or whose instance dies, on max_attempts instances in a row
                # fails its episode instead of taking down instance after instance.
                failure = RequestsFailed(f"{part.group.n} requests of {part.owner.agent} failed on "
                                         f"{part.attempt} instances in a row; the last, {worker}: {exc}")
                log.error("%s", failure)
                _fail(part.owner, failure)
            else:
                part.attempt += 1
                again.append(part)
        if again:
            log.warning("re-issuing %d unfinished samples after %s on %s: %s", sum(p.group.n for p in again),
                        "a worker death" if isinstance(exc, WorkerDied) else "an error", worker, exc)
            self.reissued += sum(p.group.n for p in again)
            self._queue(again)


def _cut(part: _Part, sizes: list[int]) -> list[_Part]:
    """A group cut into contiguous parts of `sizes` (itself, when whole): member j of the
    part starting at `first` keeps its seed, seed + first + j."""
    if len(sizes) == 1:
        return [part]
    pieces, first, g = [], part.group.first, part.group
    for size in sizes:
        piece = protocol.GenGroup(g.key, g.agent, size, g.prompt_ids, g.max_tokens, g.temperature,
                                  g.seed + first - g.first, first, g.top_p, g.top_k, g.stop, g.stop_token_ids,
                                  g.ignore_eos, g.version, g.turn, g.score_from, g.score_top_k)
        pieces.append(_Part(piece, part.owner, part.after, part.attempt))
        first += size
    return pieces


def _named(group: protocol.GenGroup) -> str:
    """The group, or the later turn, for people."""
    return str(TurnKey(group.key, group.first, group.turn)) if group.turn else str(group.key)


def _parts(groups: list[protocol.GenGroup]) -> ev.Parts:
    """How the event log names these groups' samples."""
    # One loop (most messages carry a group or two: four list comprehensions cost twice as much).
    keys, firsts, ns, turns = [], [], [], []
    for g in groups:
        keys.append(g.key)
        firsts.append(g.first)
        ns.append(g.n)
        turns.append(g.turn)
    return ev.Parts(keys, firsts, ns, turns if any(turns) else [])


def _by_agent(parts: list[_Part]) -> dict[str, list[_Part]]:
    out: dict[str, list[_Part]] = {}
    for p in parts:
        out.setdefault(p.owner.agent, []).append(p)
    return out


def _answered(part: _Part) -> None:
    """The part is no longer on its instance: nothing there to abort."""
    sent = part.owner.sent
    for i, other in enumerate(sent):  # one or a few: a group's parts, by identity
        if other is part:
            del sent[i]
            return


def _fail(owner: _Group, exc: BaseException) -> None:
    if not owner.future.done():
        owner.future.set_exception(exc)


def _report_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("rollout routing failed: %r", task.exception())
