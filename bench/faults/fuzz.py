"""Hostile-input benchmark: a real controller and a real worker session under a flood of
frames they must reject, while each keeps serving a legitimate peer.

Controller side: a ControllerServer with its receive and heartbeat loops (as an
Experiment runs them) and one legitimate worker (a WorkerSession answering Echo). From a
thread, `fuzzing.ControllerFlood` sends --frames frames from a stranger and from a
registered intruder, neither of which reads; meanwhile the controller calls Echo on the
legitimate worker every --probe-ms. Then --raw-connections plain TCP connections write
random bytes (not ZeroMQ at all) to the controller's port.

Worker side: a WorkerSession connected to `fuzzing.FakeController`, which sends it
--frames malformed frames from a thread and probes it with Echo every --probe-ms.

Both run in this process (the flood in a thread, the receivers on the asyncio loop), so
the probe latencies include the flood's share of the CPU; RSS is this process's. The
receivers use max_message_bytes = --max-kib so the oversized cases stay cheap.

    .venv/bin/python bench/faults/fuzz.py [--frames 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import socket
import statistics
import time
from urllib.parse import urlsplit

import zmq

from flexmarl.controller.control.server import ControllerServer
from flexmarl.runtime import protocol as p
from flexmarl.runtime.aio import limit_threads, run_async
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.transport import MAX_BUFFERS, RECV_HWM, SEND_HWM
from flexmarl.workers.session import CommandHandler, WorkerSession
from flexmarl.controller.testing import fuzzing


class EchoHandler(CommandHandler):
    role = "trainer"


class CountingHandler(logging.Handler):
    """Counts the log lines that report a dropped inbound message."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("dropped message from") or "dropped a message" in text:
            self.dropped += 1


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def percentiles(latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    if not ms:
        return "no probes"
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return (f"{len(ms)} probes: p50 {pick(0.5):.1f} ms, p99 {pick(0.99):.1f} ms, max {ms[-1]:.1f} ms, "
            f"mean {statistics.mean(ms):.1f} ms")


async def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return predicate()


async def controller_side(args, cfg: TransportConfig, counter: CountingHandler) -> dict:
    server = ControllerServer(cfg)
    server.bind()
    tasks = [asyncio.create_task(server.serve(), name="receive"),
             asyncio.create_task(server.heartbeat(), name="heartbeat")]
    healthy = WorkerSession(cfg, server.address, EchoHandler(), worker_id="legit")
    tasks.append(asyncio.create_task(healthy.run(), name="legit-worker"))
    hostile = fuzzing.ControllerFlood(server.address)
    try:
        await server.wait_for_workers({"trainer": 1}, 10)
        rss_before = rss_mib()[0]
        logged_before = counter.dropped
        started = time.perf_counter()
        flood = asyncio.create_task(asyncio.to_thread(
            hostile.run, fuzzing.controller_plan(args.seed, args.frames, cfg.max_message_bytes)))
        latencies = []
        # Probe until the receiver has worked through the flood, not only until the thread
        # has handed it to the sockets (small frames sit in socket buffers for a while).
        deadline = time.monotonic() + 120
        while (not flood.done() or sum(server.rejected.values()) < args.frames) and time.monotonic() < deadline:
            t0 = time.perf_counter()
            await server.call("legit", p.Echo(server.next_request_id(), b"probe"), timeout=args.probe_timeout_s)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(args.probe_ms / 1000)
        sent = await flood
        complete = await wait_for(lambda: sum(server.rejected.values()) >= args.frames, 60)
        seconds = time.perf_counter() - started
        t0 = time.perf_counter()
        await server.call("legit", p.Echo(server.next_request_id(), b"after"), timeout=args.probe_timeout_s)
        latencies.append(time.perf_counter() - t0)
        hostile.close()
        rejected, logged = dict(server.rejected), counter.dropped - logged_before
        raw_rejected = await raw_tcp(server, args)
        await server.call("legit", p.Echo(server.next_request_id(), b"after raw"), timeout=args.probe_timeout_s)
        legit = server.registry.workers["legit"]
        return {
            "sent": sent, "rejected": rejected, "rejected_total": sum(rejected.values()),
            "complete": complete, "logged": logged, "seconds": seconds,
            "latencies": latencies, "undelivered": dict(server.undelivered),
            "crashed": [t.get_name() for t in tasks if t.done()],
            "legit_alive": legit.alive, "legit_silent_s": time.monotonic() - legit.last_seen,
            "rss": (rss_before, *rss_mib()), "raw_rejected": raw_rejected,
        }
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        server.close()


async def raw_tcp(server: ControllerServer, args) -> int:
    """Plain TCP connections that write random bytes to the controller's port. libzmq
    closes them during its handshake; what it does decode as frames must be rejected."""
    host, port = urlsplit(server.address).hostname, urlsplit(server.address).port
    rng = random.Random(args.seed)
    before = sum(server.rejected.values())

    def blast() -> None:
        for _ in range(args.raw_connections):
            with socket.create_connection((host, port), timeout=5) as conn:
                try:
                    conn.sendall(rng.randbytes(rng.randint(1, 4096)))
                except OSError:
                    pass  # libzmq may hang up first

    await asyncio.to_thread(blast)
    await asyncio.sleep(1.0)
    return sum(server.rejected.values()) - before


async def worker_side(args, cfg: TransportConfig, counter: CountingHandler) -> dict:
    ctx = zmq.Context()
    fake = fuzzing.FakeController(ctx, cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s)
    session = WorkerSession(cfg, fake.address, EchoHandler(), worker_id="target")
    task = asyncio.create_task(session.run())
    try:
        rss_before = rss_mib()[0]
        logged_before = counter.dropped
        started = time.perf_counter()
        sent, latencies = await asyncio.to_thread(
            fuzzing.flood_worker, fake, fuzzing.worker_plan(args.seed + 1, args.frames, cfg.max_message_bytes),
            args.probe_ms / 1000, args.probe_timeout_s)
        complete = await wait_for(lambda: sum(session.rejected.values()) >= args.frames, 60)
        return {
            "sent": sent, "rejected": dict(session.rejected), "rejected_total": sum(session.rejected.values()),
            "complete": complete, "logged": counter.dropped - logged_before,
            "seconds": time.perf_counter() - started, "latencies": latencies,
            "crashed": ["session"] if task.done() else [], "heartbeats": fake.heartbeats,
            "rss": (rss_before, *rss_mib()),
        }
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fake.close()
        ctx.term()


def report(name: str, r: dict, frames: int) -> None:
    print(f"\n== {name}")
    print(f"frames sent           {sum(r['sent'].values())} in {r['seconds']:.1f} s "
          f"({sum(r['sent'].values()) / r['seconds']:.0f} frames/s through the receiver)")
    print(f"rejected              {r['rejected_total']}  (logged {r['logged']}, all accounted: "
          f"{r['rejected_total'] == r['logged'] == frames})")
    for reason, n in sorted(r["rejected"].items(), key=lambda kv: -kv[1]):
        print(f"  {reason:<24}{n}")
    print("frames sent by case   " + ", ".join(f"{c} {n}" for c, n in sorted(r["sent"].items(), key=lambda kv: -kv[1])))
    print(f"crashes               {len(r['crashed'])} {r['crashed'] or ''}")
    print(f"legitimate round trip {percentiles(r['latencies'])}")
    if "legit_alive" in r:
        print(f"legitimate worker     alive={r['legit_alive']}, last heard {r['legit_silent_s']:.2f} s ago")
        print(f"undelivered notices   {r['undelivered']}")
        print(f"raw TCP garbage       {r['raw_rejected']} frames rejected from non-ZeroMQ connections; "
              "controller still answers")
    else:
        print(f"heartbeats received   {r['heartbeats']} (from the worker, read during probes)")
    before, now, peak = r["rss"]
    print(f"RSS                   before {before:.0f} MiB, after {now:.0f} MiB, process peak {peak:.0f} MiB")


async def bench(args) -> None:
    counter = CountingHandler()
    logging.basicConfig(filename=args.log, level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger().addHandler(counter)
    cfg = TransportConfig(max_message_bytes=args.max_kib * 1024)
    print(f"seed {args.seed}, {args.frames} frames per side, max_message_bytes {cfg.max_message_bytes}, "
          f"heartbeat {cfg.heartbeat_interval_s}/{cfg.heartbeat_timeout_s} s, RCVHWM {RECV_HWM}, "
          f"SNDHWM {SEND_HWM}, max buffers {MAX_BUFFERS}; log: {args.log}")
    report("controller (ROUTER)", await controller_side(args, cfg, counter), args.frames)
    report("worker session (DEALER)", await worker_side(args, cfg, counter), args.frames)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-ms", type=float, default=20.0)
    parser.add_argument("--probe-timeout-s", type=float, default=10.0)
    parser.add_argument("--raw-connections", type=int, default=200)
    parser.add_argument("--max-kib", type=int, default=1024)
    parser.add_argument("--log", default="/tmp/flexmarl-fuzz.log")
    args = parser.parse_args()
    limit_threads(1)
    run_async(lambda: bench(args))


if __name__ == "__main__":
    main()
