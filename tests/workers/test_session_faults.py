"""A worker's session against a fake controller over real loopback sockets."""

import asyncio

import zmq

from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import TransportConfig
from flexmarl.workers.session import CommandHandler, WorkerSession
from flexmarl.controller.testing import fuzzing

CFG = TransportConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, handshake_timeout_s=5.0,
                      reconnect_timeout_s=0.0)


class FlakyHandler(CommandHandler):
    """Answers Echo; raises on a Generate it is handed (a bug in quick dispatch)."""

    role = "rollout"

    async def handle(self, msg, buffers):
        if isinstance(msg, p.Generate):
            raise ValueError("cannot queue this batch")
        await super().handle(msg, buffers)


def read_until(fake, kind, timeout_s=5.0):
    while True:
        _, *frames = fuzzing._recv(fake.sock, timeout_s)
        msg, _ = p.decode(frames)
        if isinstance(msg, kind):
            return msg


async def test_a_command_whose_handler_raises_fails_alone_and_the_worker_stays_up():
    ctx = zmq.Context()
    fake = fuzzing.FakeController(ctx, CFG.heartbeat_interval_s, CFG.heartbeat_timeout_s)
    session = WorkerSession(CFG, fake.address, FlakyHandler(), worker_id="flaky")
    task = asyncio.create_task(session.run())
    try:
        await asyncio.to_thread(fake.welcome)
        fake.send(p.encode(p.Generate(7, [])))
        error = await asyncio.to_thread(read_until, fake, p.Error)
        assert error.request_id == 7 and "cannot queue this batch" in error.message
        assert await asyncio.to_thread(fake.echo, 5.0) > 0
        assert not task.done() and session.rejected == {"handler error": 1}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fake.close()
        ctx.term()


async def test_worker_exits_when_its_controller_stops_reading():
    # The fake keeps the connection open but reads nothing more: the worker's replies fill
    # its send queue. It must give up after the heartbeat timeout, not hang forever.
    ctx = zmq.Context()
    fake = fuzzing.FakeController(ctx, CFG.heartbeat_interval_s, CFG.heartbeat_timeout_s)
    fake.sock.setsockopt(zmq.RCVHWM, 1)
    session = WorkerSession(CFG, fake.address, CommandHandler(), worker_id="stuck")
    task = asyncio.create_task(session.run())
    try:
        await asyncio.to_thread(fake.welcome)
        payload = b"x" * 65536
        for rid in range(3000):
            if task.done():
                break
            try:
                fake.sock.send_multipart([fake.worker, *p.encode(p.Echo(rid, payload))], zmq.DONTWAIT)
            except zmq.Again:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)
        assert await asyncio.wait_for(task, 10) == 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fake.close()
        ctx.term()
