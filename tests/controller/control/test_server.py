"""The controller's control plane over real ZeroMQ sockets, with in-process peers."""

import asyncio
import contextlib
import dataclasses

import msgspec
import pytest
import zmq
import zmq.asyncio

from flexmarl.controller.control.server import ControllerServer, RemoteError, WorkerDied
from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import ConfigError, TransportConfig
from flexmarl.runtime.transport import MAX_BUFFERS, create_curve_keys
from flexmarl.workers.session import CommandHandler, WorkerSession


class EchoHandler(CommandHandler):
    role = "trainer"  # the base handler answers Echo and refuses everything else


CFG = TransportConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6, handshake_timeout_s=2.0,
                      max_message_bytes=1024 * 1024, reconnect_timeout_s=0.0)


@contextlib.asynccontextmanager
async def controller(cfg=CFG):
    server = ControllerServer(cfg)
    server.bind()
    tasks = [asyncio.create_task(server.serve()), asyncio.create_task(server.heartbeat())]
    try:
        yield server
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        server.close()


@contextlib.asynccontextmanager
async def healthy_worker(server, worker_id="healthy", cfg=CFG):
    session = WorkerSession(cfg, server.address, EchoHandler(), worker_id=worker_id)
    task = asyncio.create_task(session.run())
    await server.wait_for_workers({"trainer": 1}, PATIENCE)
    try:
        yield session, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def echo(server, worker_id, payload=b"ping"):
    rid = server.next_request_id()
    reply, buffers = await server.call(worker_id, p.Echo(rid, payload), [b"buf"], timeout=2)
    assert isinstance(reply, p.EchoReply) and reply.payload == payload
    assert bytes(buffers[0]) == b"buf"


def raw_dealer(server, identity=b"raw", options=()):
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in options:
        sock.setsockopt(option, value)
    sock.connect(server.address)
    return sock


# How long a test waits for something that should happen at once: a bound on a stall,
# not a timing, generous because CI machines are slow and shared.
PATIENCE = 20.0


def hello(worker_id, version=p.PROTOCOL_VERSION):
    return p.encode(p.Hello(version, worker_id, "trainer", "h", 1))


async def registered_dealer(server, worker_id):
    """A raw peer registered as `worker_id` (its WELCOME read)."""
    sock = raw_dealer(server, worker_id.encode())
    await sock.send_multipart(hello(worker_id))
    await asyncio.wait_for(sock.recv_multipart(), PATIENCE)  # WELCOME
    return sock


async def wait_for(predicate, timeout=PATIENCE):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_worker_registers_and_answers_commands():
    async with controller() as server, healthy_worker(server):
        await echo(server, "healthy")
        info = server.registry.workers["healthy"]
        assert info.alive and info.role == "trainer" and info.devices == ["cpu"]


async def test_hello_reports_the_workers_devices_and_pinned_gpus_and_the_registry_keeps_them():
    async with controller() as server:
        session = WorkerSession(CFG, server.address, EchoHandler(), worker_id="pinned",
                                devices=["cuda:0", "cuda:1"], visible_gpus=["2", "3"])
        task = asyncio.create_task(session.run())
        try:
            await server.wait_for_workers({"trainer": 1}, PATIENCE)
            await echo(server, "pinned")  # the session is past its handshake: cancelling it is clean
            info = server.registry.workers["pinned"]
            assert info.devices == ["cuda:0", "cuda:1"] and info.visible_gpus == ["2", "3"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


BAD_INPUTS = {
    "garbage frames": [b"\x00\x01\x02"],
    "kind alone": [bytes([p.Kind.ECHO])],
    "kind and body in two frames": [bytes([p.Kind.ECHO]), msgspec.msgpack.encode(p.Echo(1))],
    "unknown kind": [bytes([250]) + b"\x90"],
    "undecodable body": [bytes([p.Kind.HELLO]) + b"\xc1not msgpack"],
    "wrong body for kind": [bytes([p.Kind.HELLO]) + msgspec.msgpack.encode(p.Shutdown("x"))],
    "oversized message": [bytes([p.Kind.ECHO]) + b"x" * (CFG.max_message_bytes + 1)],
    "string that is not UTF-8": [bytes([p.Kind.BYE]) + b"\x91\xa1\xff"],
    "too many frames": [*p.encode(p.Echo(1)), *[b""] * (MAX_BUFFERS + 1)],
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
async def test_bad_input_is_rejected_while_a_healthy_worker_keeps_working(name, caplog):
    async with controller() as server, healthy_worker(server):
        bad = raw_dealer(server)
        try:
            await bad.send_multipart(BAD_INPUTS[name])
            assert await wait_for(lambda: sum(server.rejected.values()) >= 1)
            await echo(server, "healthy")
        finally:
            bad.close()
        assert "dropped message" in caplog.text
        assert server.registry.workers["healthy"].alive


async def test_rejections_are_counted_by_category_so_distinct_garbage_cannot_grow_the_counter():
    async with controller() as server, healthy_worker(server):
        intruder = raw_dealer(server, b"intruder")
        try:
            await intruder.send_multipart(hello("intruder"))
            await asyncio.wait_for(intruder.recv_multipart(), PATIENCE)  # WELCOME
            for rid in range(1000, 1050):
                await intruder.send_multipart(p.encode(p.EchoReply(rid)))
            for kind in range(200, 220):
                await intruder.send_multipart([bytes([kind]) + b"\x90"])
            assert await wait_for(lambda: sum(server.rejected.values()) == 70)
            assert server.rejected == {"unknown request": 50, "unknown kind": 20}
            await echo(server, "healthy")
        finally:
            intruder.close()


async def test_an_overlong_worker_id_is_refused_and_not_logged_in_full(caplog):
    async with controller() as server:
        bad = raw_dealer(server)
        try:
            await bad.send_multipart(hello("w" * 100_000))
            reply, _ = p.decode(await asyncio.wait_for(bad.recv_multipart(), PATIENCE))
            assert isinstance(reply, p.Reject) and "longer than" in reply.reason
            assert not server.registry.workers
        finally:
            bad.close()
        assert max(len(r.getMessage()) for r in caplog.records) < 1000


@pytest.mark.slow
async def test_a_peer_that_never_reads_cannot_stall_the_controller():
    # Each malformed message from a registered peer earns it an Error notice; this one
    # never reads them, so its queue fills. The controller must drop further notices to
    # it rather than wait, and go on accepting and serving other workers.
    async with controller(dataclasses.replace(CFG, heartbeat_timeout_s=60.0)) as server:
        # Small queues and kernel buffer on its side: the controller's queue fills sooner.
        deaf = raw_dealer(server, b"deaf", [(zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)])
        try:
            await deaf.send_multipart(hello("deaf"))
            await asyncio.wait_for(deaf.recv_multipart(), PATIENCE)  # WELCOME
            sent = 0
            while not server.undelivered["peer not reading"]:
                await deaf.send_multipart(p.encode(p.Heartbeat(sent)))  # alive, only deaf
                for _ in range(500):
                    await asyncio.wait_for(deaf.send_multipart([bytes([p.Kind.ECHO_REPLY]) + b"x" * 2000]), PATIENCE)
                sent += 500
                assert sent < 100_000, "the controller never found the deaf peer's queue full"
                await asyncio.sleep(0.01)
            healthy = WorkerSession(CFG, server.address, EchoHandler(), worker_id="healthy")
            task = asyncio.create_task(healthy.run())
            assert await wait_for(lambda: "healthy" in server.registry.workers)
            await echo(server, "healthy")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            deaf.close()


async def test_a_flood_of_queued_garbage_does_not_starve_the_other_tasks():
    # Frames already queued make each receive complete at once; the receive loop must
    # still let other tasks (heartbeats, the training driver) run, after at most
    # MESSAGES_PER_TURN messages (one turn of the event loop), not after each.
    from flexmarl.controller.control.server import MESSAGES_PER_TURN

    server = ControllerServer(CFG)
    server.bind()
    ctx = zmq.Context()
    flooder = ctx.socket(zmq.DEALER)
    flooder.setsockopt(zmq.LINGER, 0)
    flooder.connect(server.address)
    for _ in range(200):
        flooder.send_multipart([b"\x00\x01"])
    await asyncio.sleep(0.5)  # let them reach the controller's queues
    seen = []

    async def ticker():
        while True:
            seen.append(sum(server.rejected.values()))
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(server.serve()), asyncio.create_task(ticker())]
    try:
        assert await wait_for(lambda: sum(server.rejected.values()) == 200)
        counted = sorted({0, *seen, 200})
        assert max(b - a for a, b in zip(counted, counted[1:])) <= MESSAGES_PER_TURN  # the ticker ran every turn
        assert len([n for n in counted if 0 < n < 200]) >= 200 // MESSAGES_PER_TURN - 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        flooder.close()
        ctx.term()
        server.close()


async def test_wrong_protocol_version_is_refused_with_a_reason():
    async with controller() as server, healthy_worker(server):
        bad = raw_dealer(server)
        try:
            await bad.send_multipart(hello("old", version=p.PROTOCOL_VERSION + 1))
            reply, _ = p.decode(await asyncio.wait_for(bad.recv_multipart(), PATIENCE))
            assert isinstance(reply, p.Reject) and "protocol version" in reply.reason
            assert "old" not in server.registry.workers
            await echo(server, "healthy")
        finally:
            bad.close()


async def test_duplicate_worker_id_is_refused_and_the_first_keeps_working():
    async with controller() as server, healthy_worker(server):
        bad = raw_dealer(server, b"impostor")
        try:
            await bad.send_multipart(hello("healthy"))
            reply, _ = p.decode(await asyncio.wait_for(bad.recv_multipart(), PATIENCE))
            assert isinstance(reply, p.Reject) and "already registered" in reply.reason
            await echo(server, "healthy")
        finally:
            bad.close()


async def test_worker_session_exits_with_code_2_when_refused():
    async with controller() as server, healthy_worker(server):
        dup = WorkerSession(CFG, server.address, EchoHandler(), worker_id="healthy")
        assert await asyncio.wait_for(dup.run(), PATIENCE) == 2
        await echo(server, "healthy")


async def test_a_worker_id_whose_process_died_registers_again_as_a_new_incarnation():
    async with controller() as server:
        first = raw_dealer(server, b"first")
        second = raw_dealer(server, b"second")
        try:
            await first.send_multipart(hello("w"))
            await asyncio.wait_for(first.recv_multipart(), PATIENCE)  # WELCOME
            rid = server.next_request_id()
            call = asyncio.create_task(server.call("w", p.Echo(rid)))
            await asyncio.sleep(0)
            died = []
            server.on_died.append(lambda info: died.append((info.worker_id, info.why_gone)))
            # whoever started it saw its process end: dead now, not after the heartbeat timeout
            server.worker_exited("w", "its process exited with code -9")
            assert died == [("w", "its process exited with code -9")]
            with pytest.raises(WorkerDied):
                await asyncio.wait_for(call, PATIENCE)
            await second.send_multipart(hello("w"))
            reply, _ = p.decode(await asyncio.wait_for(second.recv_multipart(), PATIENCE))
            assert isinstance(reply, p.Welcome)
            info = server.registry.workers["w"]
            assert info.alive and info.identity == b"second"
        finally:
            first.close()
            second.close()


async def test_a_reply_carrying_the_workers_load_updates_it_as_a_heartbeat_would():
    async with controller() as server:
        sock = await registered_dealer(server, "raw")
        info = server.registry.workers["raw"]
        await sock.send_multipart(p.encode(p.Heartbeat(1, {"busy_s": 1.0})))
        assert await wait_for(lambda: info.load == {"busy_s": 1.0})
        done = server.stream("raw", p.Generate(7, []), None)
        await sock.send_multipart(p.encode(p.Generated(7, [], True, {"busy_s": 2.5})))
        await asyncio.wait_for(done, PATIENCE)
        assert info.load == {"busy_s": 2.5}  # the reply's, no heartbeat since
        await sock.send_multipart(p.encode(p.Generated(8, [], True)))  # an unknown request: refused...
        assert await wait_for(lambda: server.rejected["unknown request"] == 1)
        assert info.load == {"busy_s": 2.5}  # ... and a reply without a load leaves it
        sock.close()


async def test_silent_worker_is_declared_dead_and_its_requests_fail():
    async with controller() as server:
        silent = await registered_dealer(server, "silent")
        try:
            rid = server.next_request_id()
            call = asyncio.create_task(server.call("silent", p.Echo(rid)))
            with pytest.raises(WorkerDied, match="no heartbeat"):
                await asyncio.wait_for(call, PATIENCE)
            assert not server.registry.workers["silent"].alive
        finally:
            silent.close()


async def test_request_failure_reported_by_worker_raises_remote_error():
    async with controller() as server, healthy_worker(server):
        rid = server.next_request_id()
        with pytest.raises(RemoteError, match="cannot handle OptimStep"):
            await server.call("healthy", p.OptimStep(rid, "a", 1, samples=0), timeout=2)


async def test_worker_exits_when_the_controller_is_gone():
    async with controller() as server:
        session = WorkerSession(CFG, server.address, EchoHandler(), worker_id="orphan")
        task = asyncio.create_task(session.run())
        assert await wait_for(lambda: "orphan" in server.registry.workers)
    # the controller's sockets are closed now: the worker must notice and exit by itself
    assert await asyncio.wait_for(task, PATIENCE) == 3


def test_binding_a_public_address_without_curve_keys_is_refused():
    server = ControllerServer(TransportConfig(address="tcp://0.0.0.0:0"))
    try:
        with pytest.raises(ConfigError, match="CURVE"):
            server.bind()
    finally:
        server.close()


async def test_curve_authenticated_worker_connects_and_an_unkeyed_one_cannot(tmp_path):
    keys = str(tmp_path / "keys")
    create_curve_keys(keys)
    cfg = TransportConfig(address="tcp://0.0.0.0:0", heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6,
                          handshake_timeout_s=1.0, curve_dir=keys)
    async with controller(cfg) as server:
        address = server.address.rsplit(":", 1)
        address = f"tcp://127.0.0.1:{address[1]}"
        session = WorkerSession(cfg, address, EchoHandler(), worker_id="keyed")
        task = asyncio.create_task(session.run())
        assert await wait_for(lambda: "keyed" in server.registry.workers)
        await echo(server, "keyed")
        plain_cfg = TransportConfig(address=address, handshake_timeout_s=1.0)
        plain = WorkerSession(plain_cfg, address, EchoHandler(), worker_id="plain")
        assert await asyncio.wait_for(plain.run(), PATIENCE) == 3  # never welcomed
        assert "plain" not in server.registry.workers
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_workers_leaving_after_shutdown_are_not_reported_as_deaths_but_their_requests_fail():
    async with controller() as server:
        worker = await registered_dealer(server, "w")
        try:
            died = []
            server.on_died.append(lambda info: died.append(info.worker_id))
            call = asyncio.create_task(server.call("w", p.Echo(server.next_request_id())))
            await server.broadcast_shutdown("experiment finished")
            await worker.send_multipart(p.encode(p.Bye("shutdown")))
            assert await server.wait_until_gone(["w"], PATIENCE)
            assert server.registry.workers["w"].why_gone == "left: shutdown"
            with pytest.raises(WorkerDied):
                await asyncio.wait_for(call, PATIENCE)
            assert died == []
        finally:
            worker.close()


async def test_a_controller_held_past_the_timeout_keeps_its_workers_and_they_keep_it():
    # The controller and the worker share this loop: holding it holds both, as a stalled
    # or stopped process holds all of its own. Neither end counts its own silence against the other.
    async with controller() as server, healthy_worker(server) as (session, task):
        await echo(server, "healthy")
        import time
        time.sleep(3 * CFG.heartbeat_timeout_s)  # the whole loop held: no heartbeat read or sent
        for _ in range(5):  # several heartbeat intervals and timeouts' worth of turns after it
            await echo(server, "healthy")
            await asyncio.sleep(CFG.heartbeat_timeout_s / 2)
        assert server.registry.workers["healthy"].alive and not task.done()


async def fill_until_it_stays_full(server, identity, rounds=50):
    """Sends to a peer that does not read until its queue is full and stays full: ZeroMQ's
    I/O thread drains the queue into the kernel's buffers until those fill too, so a queue
    found full once may take more a moment later."""
    sent = 0
    for _ in range(rounds):
        taken = 0
        for _ in range(100_000):
            try:
                server.socket.send_nowait(identity, p.Heartbeat(sent), [b"x" * 2000])
            except zmq.Again:
                break
            sent += 1
            taken += 1
        else:
            raise AssertionError("the deaf peer's queue never filled")
        if not taken and sent:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the deaf peer's queue kept taking messages ({sent} sent)")


async def test_requests_are_sent_at_once_in_order_up_to_the_first_worker_whose_queue_is_full():
    # The rollout client's GENERATE messages of one routing turn go out without a task
    # (`send_now`); the first whose worker does not read, and all after it, are left for
    # `send_request`, which waits for room: none passes one before it.
    async with controller(dataclasses.replace(CFG, heartbeat_timeout_s=60.0)) as server, healthy_worker(server):
        deaf = raw_dealer(server, b"deaf", [(zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)])
        try:
            await deaf.send_multipart(hello("deaf"))
            await asyncio.wait_for(deaf.recv_multipart(), PATIENCE)  # WELCOME
            info = server.registry.workers["deaf"]
            await fill_until_it_stays_full(server, info.identity)
            requests = [("healthy", p.Echo(server.next_request_id(), b"first")),
                        ("deaf", p.Echo(server.next_request_id(), b"held")),
                        ("healthy", p.Echo(server.next_request_id(), b"after"))]
            futures = [server.stream(w, msg, None) for w, msg in requests]
            assert server.send_now(requests) == 1
            reply, _ = await asyncio.wait_for(futures[0], PATIENCE)
            assert reply.payload == b"first"
            await asyncio.sleep(0.1)
            assert not futures[2].done()  # not sent: it waits behind the held one
            for f in futures[1:]:
                f.cancel()
        finally:
            deaf.close()


async def test_a_request_is_sent_at_once_and_one_held_by_a_full_queue_waits_until_cancelled():
    # `request` is `call` without a task (a weight sync's load to each instance): written in
    # the caller's turn; where the worker's queue is full, a task waits for room, and goes
    # when its request's future is cancelled; to a worker not there, the future has failed.
    async with controller(dataclasses.replace(CFG, heartbeat_timeout_s=60.0)) as server, healthy_worker(server):
        reply, _ = await asyncio.wait_for(server.request("healthy", p.Echo(server.next_request_id(), b"now")), PATIENCE)
        assert reply.payload == b"now" and not server._sending
        gone = server.request("nobody", p.Echo(server.next_request_id()))
        assert gone.done() and isinstance(gone.exception(), WorkerDied)
        deaf = raw_dealer(server, b"deaf", [(zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)])
        try:
            await deaf.send_multipart(hello("deaf"))
            await asyncio.wait_for(deaf.recv_multipart(), PATIENCE)  # WELCOME
            await fill_until_it_stays_full(server, server.registry.workers["deaf"].identity)
            held = server.request("deaf", p.Echo(server.next_request_id(), b"held"))
            assert len(server._sending) == 1 and not held.done()
            await asyncio.sleep(0.05)
            assert not held.done()
            held.cancel()
            assert await wait_for(lambda: not server._sending)
            await echo(server, "healthy")  # the server goes on serving the others
        finally:
            deaf.close()
