"""A stand-in for the controller's server as the rollout client and the instance moves
use it: rollout workers that answer only when a test says so, and die when told."""

import asyncio
import itertools

from flexmarl.controller.control.registry import WorkerInfo, WorkerRegistry
from flexmarl.controller.control.server import WorkerDied
from flexmarl.runtime import protocol


class FakeServer:
    """The methods RolloutClient uses, with workers that never answer on their own."""

    def __init__(self, workers: list[str]) -> None:
        self.registry = WorkerRegistry()
        for w in workers:
            self.registry.workers[w] = WorkerInfo(w, w.encode(), "rollout", "host", 1, [], {}, 0.0)
        self.sent: list[tuple[str, protocol.Generate]] = []
        self.streams: dict[int, tuple] = {}
        self.on_died: list = []
        self._ids = itertools.count(1)
        self.closing = False

    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def next_request_id(self) -> int:
        return next(self._ids)

    def stream(self, worker, msg, on_reply):
        future = asyncio.get_running_loop().create_future()
        self.streams[msg.request_id] = (worker, on_reply, future)
        return future

    async def send_request(self, worker, msg):
        self.sent.append((worker, msg))

    def request(self, worker, msg):  # through the `call` a test gives it
        return asyncio.ensure_future(self.call(worker, msg))

    def send_now(self, requests):
        self.sent.extend(requests)
        return len(requests)

    def kill(self, worker: str) -> None:
        """As the server declares a worker dead: its requests fail, then the listeners
        (the instances' owner among them) hear of it."""
        info = self.registry.workers[worker]
        info.alive = False
        for w, _, future in self.streams.values():
            if w == worker and not future.done():
                future.set_exception(WorkerDied(worker, "killed by the test"))
        for listener in self.on_died:
            listener(info)

    def answer(self, request_id: int, refuse: frozenset = frozenset(), version: int = 0, cached: int = 0,
               aborted: frozenset = frozenset()) -> None:
        """Every group of the request comes back (token 7, logprob -0.1 per member; `cached`
        prompt tokens found in the prefix cache), but those whose key's call is in `refuse`
        (refused) or `aborted` (refused as aborted)."""
        worker, on_reply, future = self.streams[request_id]
        msg = next(m for w, m in self.sent if m.request_id == request_id and isinstance(m, protocol.Generate))
        results = [protocol.GroupResult(g.key, g.first, version, [1] * g.n, protocol.packed("i", [7] * g.n),
                                        protocol.packed("f", [-0.1] * g.n), ["length"] * g.n, cached, g.turn)
                   for g in msg.groups if g.key.call not in refuse | aborted]
        refused = [protocol.GroupRefused(g.key, g.first, "prompt too long", g.turn) for g in msg.groups
                   if g.key.call in refuse]
        refused += [protocol.GroupRefused(g.key, g.first, "aborted", g.turn, aborted=True) for g in msg.groups
                    if g.key.call in aborted]
        if on_reply(protocol.Generated(request_id, results, True, {}, refused), []):
            future.set_result((None, []))


async def until(condition, turns: int = 100) -> None:
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")
