"""`ctx.call` and `ctx.env_session` in a workflow: with environment workers they go to the
run's environment client, named by the calling episode; without, they run here; a session
is closed however its `async with` ends (done, failed, cancelled)."""

import asyncio
import concurrent.futures

import pytest
from test_workflow import FakeGenerator, make_ctx

from flexmarl.controller.episodes.workflow import ToolPool, run_episode
from flexmarl.controller.state.store import ExperienceStore


def score(text):
    return len(text)


class Tally:
    closed: list = []

    def __init__(self, start):
        self.total = start

    def add(self, k):
        self.total += k
        return self.total

    def close(self):
        Tally.closed.append(self.total)


class FakeRemote:
    """The environment client as a workflow sees it: what was asked, and sessions."""

    def __init__(self):
        self.calls, self.sessions = [], []

    async def call(self, fn, args, kwargs, timeout_s, episode=""):
        self.calls.append((fn, args, kwargs, timeout_s, episode))
        return fn(*args, **kwargs)

    async def open_session(self, factory, args, kwargs, timeout_s, episode=""):
        session = FakeSession(factory(*args, **kwargs), episode)
        self.sessions.append(session)
        return session


class FakeSession:
    def __init__(self, obj, episode):
        self.obj, self.episode, self.closed = obj, episode, False

    async def add(self, k):
        return self.obj.add(k)

    def close_soon(self):
        self.closed = True


def ctx_with(tools, episode_id="s1q0"):
    ctx = make_ctx(ExperienceStore(["a", "b"]), FakeGenerator(), episode_id)
    ctx.tools = tools
    return ctx


async def test_with_environment_workers_a_call_goes_to_them_named_by_its_episode_with_its_timeout():
    remote = FakeRemote()
    ctx = ctx_with(ToolPool(None, 7.0, remote))
    assert await ctx.call(score, "abc") == 3
    assert await ctx.call(score, text="ab", timeout=2.0) == 2
    assert remote.calls == [(score, ("abc",), {}, 7.0, "s1q0"), (score, (), {"text": "ab"}, 2.0, "s1q0")]


async def test_a_session_on_environment_workers_is_closed_when_its_episode_fails_or_is_cancelled():
    remote = FakeRemote()

    async def fails(ctx):
        async with ctx.env_session(Tally, 1) as env:
            assert await env.add(2) == 3
            raise ValueError("the episode's own bug")

    why = await run_episode(fails, ctx_with(ToolPool(None, 5.0, remote)), 5.0)
    assert "ValueError: the episode's own bug" in why
    assert [(s.episode, s.closed) for s in remote.sessions] == [("s1q0", True)]

    opened = asyncio.Event()

    async def hangs(ctx):
        async with ctx.env_session(Tally, 1):
            opened.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(run_episode(hangs, ctx_with(ToolPool(None, 5.0, remote), "s1q1"), 60.0))
    await opened.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert [s.closed for s in remote.sessions] == [True, True]


async def test_without_environment_workers_a_session_lives_here_and_its_close_runs_in_the_tool_pool():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    Tally.closed.clear()
    ctx = ctx_with(ToolPool(pool, 5.0))
    async with ctx.env_session(Tally, 10) as env:
        assert await env.add(1) == 11 and await env.call("add", 2) == 13
    pool.shutdown(wait=True)  # its close() was handed to the pool
    assert Tally.closed == [13]


async def test_a_closed_episode_opens_no_session_and_makes_no_call():
    ctx = ctx_with(ToolPool(None, 5.0, FakeRemote()))
    ctx.closed = "failed earlier"
    with pytest.raises(Exception, match="failed earlier"):
        await ctx.call(score, "x")
    with pytest.raises(Exception, match="failed earlier"):
        async with ctx.env_session(Tally, 1):
            pass
