"""Rollout routing: which instance generates which requests.

Two parts, kept apart on purpose:
- decision functions (`plan_routes` over the `ROUTING_POLICIES` table), plain Python over plain numbers, unit-tested and
  replayable without sockets;
- `RolloutClient`, the asyncio side: it coalesces every request an agent receives in one
  event-loop turn into a batch (never one message per sample), asks `plan_routes` where
  the batch goes, sends GENERATE messages, and resolves each sample's future as partial
  GENERATED replies stream back. If an instance dies, its unfinished samples are sent
  again to another instance of the same agent; the experience store refuses a second
  result for a sample, so a re-issue can never add a sample twice.

Which instances serve an agent, and the work outstanding on each, belong to the
instances' owner (instances.py): the client reads the one and reports the other to it.
An adapter agent's instances are every instance of its base, so its requests spread over
them by the same least-outstanding-work rule, its load counted with its base's other
agents' on each instance.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Callable

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol

from .failures import RunFailed
from .instances import RolloutInstances
from .server import ControllerServer, RemoteError, WorkerDied

log = logging.getLogger("flexmarl.router")


def route_batch(sizes: list[int], outstanding: dict[str, float], min_split: int = 8) -> dict[str, list[int]]:
    """Assigns request indices (with token costs `sizes`) to instances.

    Each request goes to the instance with the least outstanding work after the requests
    already placed (greedy, in order); a batch smaller than `min_split` stays on one
    instance, since splitting tiny batches only adds messages."""
    if not outstanding:
        raise ValueError("no instance to route to")
    load = dict(outstanding)
    if len(sizes) < min_split or len(load) == 1:
        target = min(load, key=lambda w: (load[w], w))
        return {target: list(range(len(sizes)))}
    plan: dict[str, list[int]] = defaultdict(list)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        target = min(load, key=lambda w: (load[w], w))
        plan[target].append(i)
        load[target] += sizes[i]
    return {w: sorted(ix) for w, ix in plan.items()}


def _least_loaded(costs: list[int], outstanding: dict[str, float], turn: int) -> dict[str, list[int]]:
    return route_batch(costs, outstanding)


def _round_robin(costs: list[int], outstanding: dict[str, float], turn: int) -> dict[str, list[int]]:
    instances = list(outstanding)
    return {instances[turn % len(instances)]: list(range(len(costs)))}


# Level 2 policies (`router.within_agent`): the static baseline and least outstanding work.
ROUTING_POLICIES: dict[str, Callable[[list[int], dict[str, float], int], dict[str, list[int]]]] = {
    "least_loaded": _least_loaded,
    "round_robin": _round_robin,
}


def plan_routes(policy: str, costs: list[int], outstanding: dict[str, float], turn: int) -> dict[str, list[int]]:
    """Where one coalesced batch of an agent's requests goes: instance -> request indices.
    `outstanding` lists the agent's live instances (in assignment order) with their
    outstanding tokens; `turn` counts the agent's earlier batches (round robin uses it).
    The live `RolloutClient` and the simulator both route through here."""
    if not outstanding:
        raise ValueError("no instance to route to")
    try:
        rule = ROUTING_POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown routing policy {policy!r} (known: {', '.join(ROUTING_POLICIES)})") from None
    return rule(costs, outstanding, turn)


class NoInstance(RunFailed):
    """No live rollout instance serves the agent, and none is on its way back: the run
    stops (it is not the episode's failure)."""


class RequestRefused(Exception):
    """The engine refused one request (empty, too long for the model, ids outside the
    vocabulary, settings it rejects); only that request's episode fails."""


class RequestsFailed(Exception):
    """Requests failed (or lost their instance) on `max_attempts` instances in a row."""


class RolloutClient:
    def __init__(self, server: ControllerServer, instances: RolloutInstances, *, instance_wait_s: float = 60.0,
                 emit: Callable[[ev.Event], object] | None = None, within_agent: str = "least_loaded",
                 version_of: Callable[[str], int] | None = None,
                 instance_expected: Callable[[], bool] = lambda: False) -> None:
        self.server = server
        # The agent's synced version, sent with each batch: an adapter agent's requests run
        # under its adapter at that version (or a newer one the instance already holds).
        self.version_of = version_of or (lambda agent: -1)
        self.emit = emit or (lambda event: None)
        self.owner = instances  # which instances serve an agent; outstanding work per instance
        # A request waits this long for an instance of its agent, and for as long as
        # `instance_expected()` says one is on its way back (a worker being restarted).
        self.instance_wait_s = instance_wait_s
        self.instance_expected = instance_expected
        self.max_attempts = 3  # a request that fails on this many instances fails its episode
        self.within_agent = within_agent
        self._turn: dict[str, int] = defaultdict(int)  # round-robin position per agent
        self.dispatched_tokens: dict[str, float] = defaultdict(float)  # per agent, for demand
        self._queued: dict[str, list[tuple[protocol.GenRequest, asyncio.Future]]] = defaultdict(list)
        self._flush_scheduled: set[str] = set()
        self._dispatching: set[asyncio.Task] = set()  # batches being sent or waited for
        self.reissued = 0
        self.refused = 0

    @property
    def outstanding(self) -> dict[str, float]:
        return self.owner.outstanding

    def instances(self, agent: str) -> list[str]:
        return self.owner.instances(agent)

    async def generate(self, agent: str, requests: list[protocol.GenRequest]) -> list[protocol.GenResult]:
        loop = asyncio.get_running_loop()
        futures = []
        for req in requests:
            fut = loop.create_future()
            self._queued[agent].append((req, fut))
            futures.append(fut)
        if agent not in self._flush_scheduled:
            self._flush_scheduled.add(agent)
            loop.call_soon(self._flush_soon, agent)
        return list(await asyncio.gather(*futures))

    def _flush_soon(self, agent: str) -> None:
        self._flush_scheduled.discard(agent)
        batch, self._queued[agent] = self._queued[agent], []
        if batch:
            task = asyncio.ensure_future(self._dispatch(agent, batch))
            self._dispatching.add(task)
            task.add_done_callback(self._dispatching.discard)
            task.add_done_callback(lambda t: _fail_all(batch, t))

    async def close(self) -> None:
        """Ends every dispatch under way (the run is over: nothing is re-issued)."""
        for task in list(self._dispatching):
            task.cancel()
        await asyncio.gather(*self._dispatching, return_exceptions=True)

    async def _dispatch(self, agent: str, batch: list[tuple[protocol.GenRequest, asyncio.Future]],
                        attempt: int = 1) -> None:
        instances = await self._wait_for_instances(agent)
        costs = [len(r.prompt_ids) + r.max_tokens for r, _ in batch]
        if attempt == 1:
            self.dispatched_tokens[agent] += sum(costs)
        plan = plan_routes(self.within_agent, costs, {w: self.outstanding[w] for w in instances}, self._turn[agent])
        self._turn[agent] += 1
        await asyncio.gather(*(self._send(agent, w, [batch[i] for i in ix], attempt) for w, ix in plan.items()))

    async def _wait_for_instances(self, agent: str) -> list[str]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.instance_wait_s
        while not (instances := self.instances(agent)):
            if self.instance_expected():
                deadline = loop.time() + self.instance_wait_s
            elif loop.time() > deadline:
                gone = [f"{w.worker_id} ({w.why_gone})" for w in self.server.registry.workers.values()
                        if w.role == "rollout" and not w.alive]
                raise NoInstance(f"the run stopped: no rollout instance served agent {agent!r} for "
                                 f"{self.instance_wait_s:g}s and none is being restarted"
                                 + (f"; gone: {', '.join(gone)}" if gone else "")
                                 + ". See the workers' logs in the run directory's logs/ folder")
            await asyncio.sleep(0.1)
        return instances

    async def _send(self, agent: str, worker: str, part: list[tuple[protocol.GenRequest, asyncio.Future]],
                    attempt: int) -> None:
        waiting = {req.sample_id: (req, fut) for req, fut in part}
        cost = {req.sample_id: len(req.prompt_ids) + req.max_tokens for req, _ in part}
        self.owner.add_work(worker, sum(cost.values()))

        def on_reply(msg: protocol.Message, _buffers: list) -> bool:
            assert isinstance(msg, protocol.Generated)
            fresh = [r for r in msg.results if r.sample_id in waiting]
            self.emit(ev.RequestsCompleted(worker, agent, msg.request_id, [r.sample_id for r in fresh],
                                           [r.version for r in fresh], sum(len(r.token_ids) for r in fresh)))
            for result in msg.results:
                entry = waiting.pop(result.sample_id, None)
                if entry is None:
                    log.warning("%s returned unknown or repeated sample %s", worker, result.sample_id)
                    continue
                self.owner.work_done(worker, cost[result.sample_id])
                if not entry[1].done():
                    entry[1].set_result(result)
            for refusal in msg.refused:  # fails its episode alone; never re-issued (same model, same refusal)
                entry = waiting.pop(refusal.sample_id, None)
                if entry is None:
                    log.warning("%s refused unknown or repeated sample %s", worker, refusal.sample_id)
                    continue
                self.owner.work_done(worker, cost[refusal.sample_id])
                self.refused += 1
                if not entry[1].done():
                    entry[1].set_exception(RequestRefused(f"{agent} on {worker} refused {refusal.sample_id}: "
                                                          f"{refusal.reason}"))
            return msg.done

        msg = protocol.Generate(self.server.next_request_id(), agent, [req for req, _ in part], self.version_of(agent))
        self.emit(ev.RequestsDispatched(worker, agent, msg.request_id, list(waiting),
                                        sum(len(r.prompt_ids) for r, _ in part)))
        future = self.server.stream(worker, msg, on_reply)
        await self.server.send_request(worker, msg)
        try:
            await future
        except (WorkerDied, RemoteError) as exc:
            # A batch that fails, or whose instance dies, on max_attempts instances in a row
            # fails its episodes instead of taking down instance after instance.
            if self.server.closing:  # shutting down: the workers leave, nothing to re-issue
                raise
            if attempt >= self.max_attempts:
                failure = RequestsFailed(f"{len(waiting)} requests of {agent} failed on {attempt} instances "
                                         f"in a row; the last, {worker}: {exc}")
                log.error("%s", failure)
                for _, fut in waiting.values():
                    if not fut.done():
                        fut.set_exception(failure)
                waiting.clear()
            else:
                log.warning("re-issuing %d unfinished samples of %s after %s: %s", len(waiting), agent,
                            "a worker death" if isinstance(exc, WorkerDied) else "an error", exc)
        finally:
            self.owner.work_done(worker, sum(cost[s] for s in waiting))
        if waiting:  # died or failed before finishing: send the rest elsewhere
            self.reissued += len(waiting)
            await self._dispatch(agent, list(waiting.values()), attempt + 1)


def _fail_all(batch: list[tuple[protocol.GenRequest, asyncio.Future]], task: asyncio.Task) -> None:
    if task.cancelled():
        exc: BaseException = asyncio.CancelledError()
    else:
        exc = task.exception()
    if exc is None:
        return
    for _, fut in batch:
        if not fut.done():
            fut.set_exception(exc)
