"""A worker's session against a bare controller socket (real ZeroMQ, in-process): what ends
it, with which exit code, and whose heartbeat settings it follows."""

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import socket as socket_module

import pytest
import zmq

from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.transport import RouterSocket
from flexmarl.workers.main import add_arguments
from flexmarl.workers import session as session_module
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
async def session_with(handler, interval=0.05, timeout=0.5, cfg=CFG, watch_loop=True):
    """A session registered with a bare ROUTER; yields (router, identity, session task)."""
    router = RouterSocket(cfg)
    router.bind()
    session = WorkerSession(cfg, router.address, handler, worker_id="w", watch_loop=watch_loop)
    handler.test_session = session
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


async def next_inbound(router, kind, timeout=5):
    """The next message of `kind` to `router`, with its sender's identity (others passed over)."""
    while True:
        inbound = await asyncio.wait_for(router.recv(), timeout)
        if isinstance(inbound.msg, kind):
            return inbound


async def next_of(router, kind):
    return (await next_inbound(router, kind)).msg


async def test_heartbeats_follow_the_interval_and_timeout_welcome_gives():
    async with session_with(Loop(), interval=0.05, timeout=0.5) as (router, _, task):
        await next_of(router, p.Heartbeat)  # sent at WELCOME's interval, not the worker's 30 s
        # the controller then falls silent: WELCOME's 0.5 s timeout ends the session, not 60 s
        assert await asyncio.wait_for(task, 10) == 3


@pytest.mark.parametrize(("ending", "code"), [(p.Shutdown("done"), 0), (p.Reject("replaced"), 2)],
                         ids=["shutdown-exits-0", "reject-exits-2"])
async def test_shutdown_or_reject_after_registration_ends_the_session_with_its_exit_code_and_closes_the_handler(
        ending, code):
    handler = Loop()
    async with session_with(handler) as (router, identity, task):
        await router.send(identity, ending)
        assert await asyncio.wait_for(task, 5) == code
    assert handler.closed


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
        await router.send(identity, p.Generate(6, []))  # not a trainer's command
        error = await next_of(router, p.Error)
        assert error.request_id == 6 and "cannot handle Generate" in error.message
        assert not task.done()


def test_the_worker_command_line_has_no_heartbeat_settings_of_its_own():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "--heartbeat" not in parser.format_help()
    with pytest.raises(SystemExit):  # the controller's WELCOME sets them; there is nothing to pass
        parser.parse_args(["--role", "rollout", "--connect", "tcp://127.0.0.1:1", "--heartbeat-interval", "0.2"])


# --------------------------------------------------------------- the controller comes back

RECONNECTING = dataclasses.replace(CFG, reconnect_timeout_s=20.0)


async def bind_again(address):
    """A new bare controller on the old one's address (its port may take a moment to free)."""
    router = RouterSocket(dataclasses.replace(CFG, address=address))
    for _ in range(100):
        try:
            router.bind()
            return router
        except zmq.ZMQError:
            await asyncio.sleep(0.05)
    router.bind()


@contextlib.asynccontextmanager
async def controller_back(router):
    """The controller goes (its socket closed) and a new bare one binds its address; yields
    (the new ROUTER, the worker's HELLO to it: the old connection's heartbeats may come first)."""
    address = router.address
    router.close()
    again = await bind_again(address)
    try:
        yield again, await next_inbound(again, p.Hello, 20)
    finally:
        again.close()


async def test_a_controller_that_no_longer_knows_the_connection_is_registered_with_again():
    # A controller restarted (or that declared the worker dead) answers it with REJECT.
    async with session_with(Loop(), cfg=RECONNECTING) as (router, identity, task):
        await router.send(identity, p.Reject("not registered: send HELLO first"))
        hello = await next_inbound(router, p.Hello, 20)
        assert hello.identity != identity and hello.msg.worker_id == "w"
        await router.send(hello.identity, p.Welcome(p.PROTOCOL_VERSION, 0.05, 0.5))
        await router.send(hello.identity, p.Echo(3, b"again"))
        assert (await next_of(router, p.EchoReply)).payload == b"again" and not task.done()


async def test_a_worker_registers_again_with_a_fresh_handler_when_its_controller_comes_back():
    first_handler = Loop()
    async with session_with(first_handler, cfg=RECONNECTING) as (router, _, task):
        session = first_handler.test_session
        # the controller is gone: the worker hears nothing more, until one binds its address again
        async with controller_back(router) as (again, hello):
            assert hello.msg.worker_id == "w"
            await again.send(hello.identity, p.Welcome(p.PROTOCOL_VERSION, 0.05, 0.5))
            await again.send(hello.identity, p.Echo(9, b"back"))
            reply = await next_of(again, p.EchoReply)
            assert reply.payload == b"back" and not task.done()
            assert session.reconnects == 1
            # its engines or training states were dropped: the controller commands it afresh
            assert first_handler.closed and session.handler is not first_handler
            assert isinstance(session.handler, Loop) and session.handler.session is session


async def test_a_worker_refused_when_it_registers_again_exits_at_once_with_code_2():
    async with session_with(Loop(), cfg=RECONNECTING) as (router, _, task):
        async with controller_back(router) as (again, hello):
            await again.send(hello.identity, p.Reject("worker id 'w' is already registered"))
            assert await asyncio.wait_for(task, 20) == 2


async def test_a_controller_that_does_not_come_back_ends_the_session_with_code_3_after_backing_off(
        monkeypatch, caplog):
    monkeypatch.setattr(session_module, "RECONNECT_FIRST_S", 0.1)
    monkeypatch.setattr(session_module, "RECONNECT_MAX_S", 0.4)
    caplog.set_level(logging.INFO, logger="flexmarl.worker")
    async with session_with(Loop(), cfg=dataclasses.replace(CFG, reconnect_timeout_s=2.0)) as (router, _, task):
        router.close()
        assert await asyncio.wait_for(task, 20) == 3
    waits = [r.getMessage().rsplit(" ", 1)[-1] for r in caplog.records if "next attempt waits" in r.getMessage()]
    assert waits[:3] == ["0.2s", "0.4s", "0.4s"]  # doubling, then capped
    assert any("did not take this worker back within 2s" in r.getMessage() for r in caplog.records)


class Replying(CommandHandler):
    """A handler whose loop sends a reply carrying its load every `every` seconds while
    `replying` is set (as a rollout worker's replies to GENERATE do)."""

    role = "rollout"

    def __init__(self, every):
        super().__init__()
        self.every = every
        self.replying = asyncio.Event()

    def load(self):
        return {"busy_s": 1.5}

    async def run(self):
        while True:
            await self.replying.wait()
            await self.session.send(p.Generated(0, [], True, self.load()))
            await asyncio.sleep(self.every)


async def test_a_worker_whose_replies_carry_its_load_sends_no_heartbeat_until_they_stop():
    handler = Replying(every=0.05)
    async with session_with(handler, interval=0.5, timeout=30.0) as (router, _, _):
        assert (await next_of(router, p.Heartbeat)).load == {"busy_s": 1.5}  # idle: heartbeats
        handler.replying.set()
        kinds = []
        loop = asyncio.get_running_loop()
        until = loop.time() + 2.0  # four intervals of replies ten to an interval
        while loop.time() < until:
            kinds.append(type((await asyncio.wait_for(router.recv(), 5)).msg))
        assert kinds.count(p.Generated) >= 4 and p.Heartbeat not in kinds
        handler.replying.clear()
        assert (await next_of(router, p.Heartbeat)).load == {"busy_s": 1.5}  # replies stopped: heartbeats again


async def test_a_session_watches_its_loop_unless_its_process_watches_it_for_all_its_sessions():
    import threading

    def watchers():
        return sum(t.name == "stall-watch" for t in threading.enumerate())

    for _ in range(100):  # an earlier test's watch thread ends within its period of being stopped (not joined)
        if not watchers():
            break
        await asyncio.sleep(0.05)
    before = watchers()
    async with session_with(Loop()) as (router, identity, task):
        await router.send(identity, p.Echo(1, b"x"))
        await next_of(router, p.EchoReply)
        assert watchers() == before + 1  # its own watch: a thread (and a ticker task)
    async with session_with(Loop(), watch_loop=False) as (router, identity, task):
        await router.send(identity, p.Echo(2, b"y"))
        await next_of(router, p.EchoReply)  # it serves as the watched one does
        assert watchers() <= before and not any(t.get_name() == "stall-watch" for t in asyncio.all_tasks())


# --------------------------------------------------------------- a worker's socket itself


@contextlib.contextmanager
def dealer_to(address, queue=None):
    """A bare ROUTER bound on `address` and a worker's DEALER connected to it (each queue
    `queue` messages long, if given); yields (router, dealer) and closes both."""
    from flexmarl.runtime.transport import DealerSocket

    cfg = TransportConfig(address=address, heartbeat_timeout_s=10.0)
    router = RouterSocket(cfg)
    dealer = DealerSocket(cfg, b"d")
    if queue is not None:
        router.sock.setsockopt(zmq.RCVHWM, queue)
        dealer.sock.setsockopt(zmq.SNDHWM, queue)
    try:
        router.bind()
        dealer.connect(router.address)
        yield router, dealer
    finally:
        dealer.close()
        router.close()


async def test_sends_that_find_the_controllers_queue_full_wait_and_no_later_send_passes_them():
    import time

    with dealer_to("inproc://full-queue", queue=1) as (router, dealer):
        sent, parked = [], None
        for i in range(100):  # fill the queue until a send has to wait
            task = asyncio.ensure_future(dealer.send(p.Heartbeat(i)))
            await asyncio.sleep(0)
            sent.append(i)
            if not task.done():
                parked = task
                break
        assert parked is not None
        while True:  # the controller reads everything queued, while the loop does not turn
            try:
                router._plain.recv_multipart(zmq.DONTWAIT)
            except zmq.Again:
                break
        time.sleep(0.05)
        later = dealer.send(p.Heartbeat(1000))  # room now: it would go at once, ahead of the parked one
        await asyncio.wait_for(asyncio.gather(parked, later), 5)
        got = []
        while len(got) < 2:
            got.append((await asyncio.wait_for(router.recv(), 5)).msg.seq)
        assert got == [sent[-1], 1000]


async def test_a_receive_waiting_wakes_for_a_message_whose_signal_a_send_took():
    import time

    with dealer_to("inproc://wake") as (router, dealer):
        await dealer.send(p.Heartbeat(1))
        identity = (await asyncio.wait_for(router.recv(), 5)).identity
        receiving = asyncio.ensure_future(dealer.recv())
        await asyncio.sleep(0.05)  # it waits for the socket's descriptor
        assert not receiving.done()
        await router.send(identity, p.Heartbeat(2))
        time.sleep(0.05)  # the message is there, its signal raised, the loop not turning
        await dealer.send(p.Heartbeat(3))  # a send goes at once, reading the socket's events
        assert (await asyncio.wait_for(receiving, 5)).msg.seq == 2


async def test_the_controllers_receive_waiting_wakes_for_a_message_whose_signal_its_send_took():
    import time

    with dealer_to("inproc://router-wake") as (router, dealer):
        await dealer.send(p.Heartbeat(1))
        identity = (await asyncio.wait_for(router.recv(), 5)).identity
        receiving = asyncio.ensure_future(router.recv())
        await asyncio.sleep(0.05)  # it waits for the socket's descriptor
        assert not receiving.done() and router._watched is asyncio.get_running_loop()
        await dealer.send(p.Heartbeat(2))
        time.sleep(0.05)  # the message is there, its signal raised, the loop not turning
        router.send_nowait(identity, p.Heartbeat(3))  # a send reads the socket's events
        assert (await asyncio.wait_for(receiving, 5)).msg.seq == 2
        assert (await asyncio.wait_for(dealer.recv(), 5)).msg.seq == 3


async def test_closing_the_controllers_socket_ends_a_receive_waiting_on_it():
    with dealer_to("inproc://router-closing") as (router, _):
        receiving = asyncio.ensure_future(router.recv())
        await asyncio.sleep(0.05)
        assert not receiving.done()
        router.close()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(receiving, 5)
        assert router._watched is None


async def test_closing_a_socket_a_receive_waits_on_ends_that_receive():
    with dealer_to("inproc://closing") as (_, dealer):
        receiving = asyncio.ensure_future(dealer.recv())
        await asyncio.sleep(0.05)
        assert not receiving.done()
        dealer.close()  # its descriptor leaves the loop; the receive does not wait forever
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(receiving, 5)


async def test_the_descriptor_stays_watched_between_receives_and_a_signal_with_none_waiting_loses_no_message():
    import time

    loop = asyncio.get_running_loop()
    with dealer_to("inproc://watched") as (router, dealer):
        await dealer.send(p.Heartbeat(1))
        identity = (await asyncio.wait_for(router.recv(), 5)).identity
        await router.send(identity, p.Heartbeat(2))
        assert (await asyncio.wait_for(dealer.recv(), 5)).msg.seq == 2
        receiving = asyncio.ensure_future(dealer.recv())  # waits: the descriptor is watched from here on
        await asyncio.sleep(0.05)
        await router.send(identity, p.Heartbeat(3))
        assert (await asyncio.wait_for(receiving, 5)).msg.seq == 3
        assert dealer.waited  # it suspended: its session needs no yield of its own after it
        assert dealer._watched is loop  # still watched, with no receive waiting
        await router.send(identity, p.Heartbeat(4))
        time.sleep(0.05)
        await asyncio.sleep(0.05)  # its signal comes while none waits, and is consumed there
        await router.send(identity, p.Heartbeat(5))
        got = [(await asyncio.wait_for(dealer.recv(), 5)).msg.seq for _ in range(2)]
        assert got == [4, 5] and not dealer.waited  # both were queued: taken without suspending
        dealer.close()
        assert dealer._watched is None


async def test_a_hello_no_connection_takes_ends_the_session_saying_no_welcome_came_not_that_a_queue_filled(caplog):
    """Before WELCOME nothing has been read or timed: a HELLO that no connection takes (no
    controller listening, or one whose CURVE handshake this worker failed) is told as the
    missing WELCOME, exit code 3, not as a full send queue after 0.0 s."""
    with socket_module.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    handler = Loop()
    cfg = dataclasses.replace(CFG, heartbeat_timeout_s=0.3)  # how long a send waits before WELCOME
    session = WorkerSession(cfg, address, handler, worker_id="w", watch_loop=False)
    session.sock.close()
    session.sock = session._new_socket(immediate=True)  # no connection: a send finds no queue
    with caplog.at_level(logging.ERROR):
        assert await asyncio.wait_for(session.run(), 10) == 3
    said = caplog.text
    assert f"no WELCOME from {address}" in said and "within 0.3s" in said and "CURVE" in said
    assert "send queue" not in said
    assert handler.closed
