"""A group the engine cannot run fails alone: the refusal rules, and the rollout handler
around an engine that refuses (a fake engine; the real one is in test_rollout.py)."""

import asyncio

import pytest

from flexmarl.runtime import protocol as p
from flexmarl.runtime.keys import GroupKey
from flexmarl.workers.rollout.engine import Completion, RequestRefused, refusal_reason
from flexmarl.workers.rollout.worker import RolloutHandler

MAX_MODEL_LEN, VOCAB = 16, 18



def K(call):
    """A group's key, named by its call."""
    return GroupKey("e", "agent", call)

@pytest.mark.parametrize("prompt, max_tokens, says", [
    ([], 4, "empty"),
    ([1, 2], 0, "max_tokens is 0"),
    ([1] * 13, 4, "exceed the engine's max_model_len 16"),
    ([1] * 17, 1, "exceed the engine's max_model_len 16"),
    ([1, 18, 2], 4, "token id 18 at position 1 is outside the model's vocabulary [0, 18)"),
    ([1, -1], 4, "token id -1 at position 1"),
])
def test_requests_the_engine_cannot_run_are_named_with_the_reason(prompt, max_tokens, says):
    assert says in refusal_reason(prompt, max_tokens, MAX_MODEL_LEN, VOCAB)


@pytest.mark.parametrize("prompt, max_tokens", [([0], 1), ([17] * 12, 4), ([1, 2, 3], 13)])
def test_requests_that_fit_the_engine_are_not_refused(prompt, max_tokens):
    assert refusal_reason(prompt, max_tokens, MAX_MODEL_LEN, VOCAB) is None


class FakeEngine:
    """Runs every request to completion in one step; refuses the way VllmEngine does."""

    def __init__(self):
        self.queued: dict[str, int] = {}

    def add(self, request_id, prompt_ids, max_tokens, temperature, seed, n=1, **sampling):
        reason = refusal_reason(prompt_ids, max_tokens, MAX_MODEL_LEN, VOCAB)
        if reason:
            raise RequestRefused(f"request {request_id!r} refused: {reason}")
        self.queued[request_id] = (n, max_tokens)

    def has_unfinished(self):
        return bool(self.queued)

    running_sequences = 0

    def step(self):
        done = [Completion(rid, [3] * (n * t), [-0.5] * (n * t), [t] * n, ["length"] * n)
                for rid, (n, t) in self.queued.items()]
        self.queued.clear()
        return done

    def close(self):
        pass


class Outbox:
    """Stands in for the session: collects what the handler sends."""

    def __init__(self):
        self.sent: list[p.Message] = []
        self.arrived = asyncio.Event()

    async def send(self, msg, buffers=()):
        self.sent.append(msg)
        self.arrived.set()


def item(key, prompt, max_tokens=4):
    return p.GenGroup(K(key), "solver", 1, prompt, max_tokens, 1.0, 0)


async def replies_until_done(outbox, request_id):
    while not any(isinstance(m, p.Generated) and m.request_id == request_id and m.done for m in outbox.sent):
        outbox.arrived.clear()
        await asyncio.wait_for(outbox.arrived.wait(), 5)
    return [m for m in outbox.sent if isinstance(m, p.Generated) and m.request_id == request_id]


async def test_a_refused_group_fails_alone_and_the_worker_keeps_serving():
    handler = RolloutHandler()
    handler.session = outbox = Outbox()
    handler.engine, handler.agent, handler.version = FakeEngine(), "solver", 3
    loop = asyncio.create_task(handler.run())
    try:
        await handler.handle(p.Generate(1, [
            item("good-0", [1, 2]), item("empty", []), item("good-1", [4]),
            item("too-long", [1] * 15), item("oov", [1, 99])]), [])
        replies = await replies_until_done(outbox, 1)
        results = [r for m in replies for r in m.results]
        refused = {r.key.call: r.reason for m in replies for r in m.refused}
        assert sorted(r.key.call for r in results) == ["good-0", "good-1"]
        assert all(r.lengths == [4] and r.version == 3 for r in results)
        assert sorted(refused) == ["empty", "oov", "too-long"]
        assert "empty" in refused["empty"] and "max_model_len" in refused["too-long"]
        assert "token id 99" in refused["oov"]
        # refusals leave nothing behind: no load counted, no sample waiting
        assert handler.load()["queued_requests"] == 0 and not handler._running

        # the next message is served as usual
        await handler.handle(p.Generate(2, [item("later", [5, 6])]), [])
        replies = await replies_until_done(outbox, 2)
        assert [r.key.call for m in replies for r in m.results] == ["later"]
        assert not any(m.refused for m in replies)
        assert not loop.done()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_a_message_refused_entirely_is_answered_done_at_once():
    handler = RolloutHandler()
    handler.session = outbox = Outbox()
    handler.engine, handler.agent, handler.version = FakeEngine(), "solver", 0
    loop = asyncio.create_task(handler.run())
    try:
        await handler.handle(p.Generate(7, [item("a", []), item("b", [1] * 20)]), [])
        [reply] = await replies_until_done(outbox, 7)
        assert reply.results == [] and [r.key.call for r in reply.refused] == ["a", "b"]
        assert not handler._running
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


def test_a_generated_message_with_refusals_round_trips_and_bodies_without_them_decode():
    msg = p.Generated(4, [p.GroupResult(K("s"), 0, 2, [1], p.packed("i", [1]), p.packed("f", [-0.5]))], True, {},
                      [p.GroupRefused(K("t"), 0, "the prompt is empty")])
    assert p.decode(p.encode(msg))[0] == msg
    import msgspec
    old = msgspec.msgpack.encode([4, [], True, {}])  # a body without `refused`
    assert p.decode([bytes((p.Kind.GENERATED,)) + old])[0].refused == []
