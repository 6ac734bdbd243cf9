"""Hostile frames against a real controller and a real worker session over loopback."""

import asyncio
import logging

import zmq

from flexmarl.controller.control.server import ControllerServer
from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import TransportConfig
from flexmarl.workers.session import CommandHandler, WorkerSession
from flexmarl.controller.testing import fuzzing

CFG = TransportConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0, handshake_timeout_s=5.0,
                      max_message_bytes=64 * 1024)
FRAMES = 300


class EchoHandler(CommandHandler):
    role = "trainer"


async def wait_for(predicate, timeout=20.0):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def test_every_generated_frame_is_one_no_receiver_may_accept():
    fuzzer = fuzzing.FrameFuzzer(0, CFG.max_message_bytes)
    for case, frames in fuzzing.worker_plan(0, 2000, CFG.max_message_bytes):
        assert fuzzer.is_rejected_by_any_receiver(frames), case


def test_plans_are_reproducible_from_their_seed():
    def plan(seed):
        return list(fuzzing.controller_plan(seed, 50, CFG.max_message_bytes))
    assert plan(3) == plan(3) and plan(3) != plan(4)


async def test_controller_rejects_every_hostile_frame_with_a_logged_reason_and_keeps_serving(caplog):
    caplog.set_level(logging.WARNING, logger="flexmarl")
    server = ControllerServer(CFG)
    server.bind()
    tasks = [asyncio.create_task(server.serve()), asyncio.create_task(server.heartbeat())]
    healthy = WorkerSession(CFG, server.address, EchoHandler(), worker_id="healthy")
    tasks.append(asyncio.create_task(healthy.run()))
    try:
        await server.wait_for_workers({"trainer": 1}, 5)
        hostile = fuzzing.ControllerFlood(server.address)
        flood = asyncio.create_task(asyncio.to_thread(
            hostile.run, fuzzing.controller_plan(1, FRAMES, CFG.max_message_bytes)))
        while not flood.done():  # the legitimate exchange goes on during the flood
            reply, _ = await server.call("healthy", p.Echo(server.next_request_id(), b"ok"), timeout=10)
            assert reply.payload == b"ok"
            await asyncio.sleep(0.02)
        sent = await flood
        assert sum(sent.values()) == FRAMES
        assert await wait_for(lambda: sum(server.rejected.values()) >= FRAMES)
        reply, _ = await server.call("healthy", p.Echo(server.next_request_id(), b"after"), timeout=10)
        assert reply.payload == b"after"
        assert sum(server.rejected.values()) == FRAMES, server.rejected
        assert "handler error" not in server.rejected
        logged = [r for r in caplog.records if r.getMessage().startswith("dropped message from")]
        assert len(logged) == FRAMES
        assert server.registry.workers["healthy"].alive
        assert not any(t.done() for t in tasks)
        hostile.close()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        server.close()


async def test_worker_session_rejects_every_hostile_frame_with_a_logged_reason_and_keeps_serving(caplog):
    caplog.set_level(logging.WARNING, logger="flexmarl")
    ctx = zmq.Context()
    fake = fuzzing.FakeController(ctx, CFG.heartbeat_interval_s, CFG.heartbeat_timeout_s)
    session = WorkerSession(CFG, fake.address, EchoHandler(), worker_id="target")
    task = asyncio.create_task(session.run())
    try:
        sent, latencies = await asyncio.to_thread(
            fuzzing.flood_worker, fake, fuzzing.worker_plan(2, FRAMES, CFG.max_message_bytes),
            probe_every_s=0.05, probe_timeout_s=10.0)
        assert sum(sent.values()) == FRAMES and len(latencies) >= 1
        assert await wait_for(lambda: sum(session.rejected.values()) >= FRAMES)
        assert sum(session.rejected.values()) == FRAMES, session.rejected
        assert "handler error" not in session.rejected
        logged = [r for r in caplog.records if "dropped a message" in r.getMessage()]
        assert len(logged) == FRAMES
        assert fake.heartbeats > 0 or await asyncio.to_thread(fake.echo, 10.0) > 0
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fake.close()
        ctx.term()
