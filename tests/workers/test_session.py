"""A worker's session against a bare controller socket (real ZeroMQ, in-process): what ends
it, with which exit code, and whose heartbeat settings it follows."""

import argparse
import asyncio
import contextlib

import pytest

from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.transport import RouterSocket
from flexmarl.workers.main import add_arguments
from flexmarl.workers.session import CommandHandler, WorkerSession

# The worker's own config: heartbeat settings far from the ones WELCOME gives below.
CFG = TransportConfig(address="tcp://127.0.0.1:0", heartbeat_interval_s=30.0, heartbeat_timeout_s=60.0,
                      handshake_timeout_s=2.0, reconnect_timeout_s=0.0)


class Loop(CommandHandler):
    """A handler whose own loop does what the test says."""

    role = "trainer"

    def __init__(self, body=None):
        super().__init__()
        self.body = body
        self.closed = False

    async def run(self):
        if self.body is None:
            await asyncio.Event().wait()
        await self.body()

    def close(self):
        self.closed = True


@contextlib.asynccontextmanager
async def session_with(handler, interval=0.05, timeout=0.5):
    """A session registered with a bare ROUTER; yields (router, identity, session task)."""
    router = RouterSocket(CFG)
    router.bind()
    session = WorkerSession(CFG, router.address, handler, worker_id="w")
    task = asyncio.create_task(session.run())
    try:
        hello = await asyncio.wait_for(router.recv(), 5)
        assert isinstance(hello.msg, p.Hello)
        await router.send(hello.identity, p.Welcome(p.PROTOCOL_VERSION, interval, timeout))
        yield router, hello.identity, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close()


async def next_of(router, kind):
    while True:
        inbound = await asyncio.wait_for(router.recv(), 5)
        if isinstance(inbound.msg, kind):
            return inbound.msg


async def test_heartbeats_follow_the_interval_and_timeout_welcome_gives():
    async with session_with(Loop(), interval=0.05, timeout=0.5) as (router, _, task):
        await next_of(router, p.Heartbeat)  # sent at WELCOME's interval, not the worker's 30 s
        # the controller then falls silent: WELCOME's 0.5 s timeout ends the session, not 60 s
        assert await asyncio.wait_for(task, 10) == 3


async def test_shutdown_ends_the_session_with_exit_code_0_and_closes_the_handler():
    handler = Loop()
    async with session_with(handler) as (router, identity, task):
        await router.send(identity, p.Shutdown("done"))
        assert await asyncio.wait_for(task, 5) == 0
    assert handler.closed


async def test_reject_after_registration_ends_the_session_with_exit_code_2():
    async with session_with(Loop()) as (router, identity, task):
        await router.send(identity, p.Reject("replaced"))
        assert await asyncio.wait_for(task, 5) == 2


async def test_a_failing_handler_loop_ends_the_session_with_a_bye_naming_it():
    async def broken():
        raise RuntimeError("engine broke")

    handler = Loop(broken)
    async with session_with(handler) as (router, _, task):
        bye = await next_of(router, p.Bye)
        assert "handler" in bye.reason and "engine broke" in bye.reason
        assert await asyncio.wait_for(task, 5) == 1
    assert handler.closed


async def test_a_handler_loop_that_returns_ends_the_session_with_exit_code_1():
    async def returns():
        return None

    async with session_with(Loop(returns)) as (_, _, task):
        assert await asyncio.wait_for(task, 5) == 1


async def test_commands_reach_the_handler_and_controller_errors_do_not_end_the_session():
    async with session_with(Loop()) as (router, identity, task):
        await router.send(identity, p.Error(0, "a complaint"))
        await router.send(identity, p.Echo(5, b"ping"))
        reply = await next_of(router, p.EchoReply)
        assert (reply.request_id, reply.payload) == (5, b"ping")
        await router.send(identity, p.Generate(6, "a", []))  # not a trainer's command
        error = await next_of(router, p.Error)
        assert error.request_id == 6 and "cannot handle Generate" in error.message
        assert not task.done()


def test_the_worker_command_line_has_no_heartbeat_settings_of_its_own():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "--heartbeat" not in parser.format_help()
    with pytest.raises(SystemExit):  # the controller's WELCOME sets them; there is nothing to pass
        parser.parse_args(["--role", "rollout", "--connect", "tcp://127.0.0.1:1", "--heartbeat-interval", "0.2"])
