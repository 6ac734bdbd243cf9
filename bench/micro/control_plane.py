"""Control-plane benchmark: controller <-> real worker processes over ZeroMQ.

Prints one JSON line per measurement:
- rtt: round-trip latency of one small message at a time (p50/p99, microseconds),
- msgs_per_s one at a time vs. pipelined (`--inflight` requests outstanding per worker),
- batched: sample requests per second when 64 travel in one message (as GENERATE does),
- tensor: MB/s moving a 4 MiB tensor frame controller -> worker -> controller (bytes
  counted once per direction), next to a plain memory copy of the same bytes.

    .venv/bin/python bench/micro/control_plane.py [--workers 2] [--messages 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import msgspec
import numpy as np

from flexmarl.controller.run.experiment import Experiment
from flexmarl.controller.tasks.digit_chain import default_config
from flexmarl.runtime import protocol as p
from flexmarl.runtime.keys import GroupKey
from flexmarl.runtime.aio import limit_threads, run_async
from flexmarl.runtime.config import load_config


async def one_at_a_time(exp: Experiment, worker: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await exp.server.call(worker, p.Echo(exp.server.next_request_id(), b"x" * 64), timeout=10)
        times.append(time.perf_counter() - t0)
    return times


async def pipelined(exp: Experiment, workers: list[str], n: int, inflight: int) -> float:
    sem = asyncio.Semaphore(inflight * len(workers))

    async def one(i: int) -> None:
        async with sem:
            await exp.server.call(workers[i % len(workers)],
                                  p.Echo(exp.server.next_request_id(), b"x" * 64), timeout=30)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def batched(exp: Experiment, worker: str, n: int, batch: int) -> float:
    """Items per second when requests travel `batch` to a message (as Generate does with groups)."""
    items = [p.GenGroup(GroupKey("e", "a", f"g{i}"), "a", 1, list(range(8)), 6, 1.0, i) for i in range(batch)]
    t0 = time.perf_counter()
    for _ in range(n // batch):
        payload = msgspec.msgpack.encode(items)
        reply, _ = await exp.server.call(worker, p.Echo(exp.server.next_request_id(), payload), timeout=10)
        assert len(msgspec.msgpack.decode(reply.payload, type=list[p.GenGroup])) == batch
    return (n // batch) * batch / (time.perf_counter() - t0)


async def tensor_rate(exp: Experiment, worker: str, nbytes: int, reps: int) -> float:
    tensor = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    await exp.server.call(worker, p.Echo(exp.server.next_request_id()), [tensor], timeout=30)
    t0 = time.perf_counter()
    for _ in range(reps):
        _, bufs = await exp.server.call(worker, p.Echo(exp.server.next_request_id()), [tensor], timeout=30)
        assert len(bufs[0]) == nbytes
    return 2 * nbytes * reps / (time.perf_counter() - t0) / 1e6


def memcpy_rate(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return nbytes * reps / (time.perf_counter() - t0) / 1e6


async def bench(args: argparse.Namespace) -> None:
    # Echo is answered by every role; the trainers are the measured peers.
    # The default job's config (a config must name agents); no agent is placed or trained here.
    cfg = load_config(None, ["cluster.rollout_workers=1", f"cluster.trainer_workers={args.workers}"],
                      defaults=default_config())
    with tempfile.TemporaryDirectory() as run_dir:
        async with Experiment(cfg, run_dir=run_dir) as exp:
            workers = exp.worker_ids("trainer")
            rtt = await one_at_a_time(exp, workers[0], args.messages)
            rtt_us = sorted(t * 1e6 for t in rtt)
            print(json.dumps({"measure": "rtt", "messages": args.messages,
                              "p50_us": round(statistics.median(rtt_us), 1),
                              "p99_us": round(rtt_us[int(0.99 * len(rtt_us)) - 1], 1),
                              "msgs_per_s": round(len(rtt) / sum(rtt))}))
            rate = await pipelined(exp, workers, args.messages * 2, args.inflight)
            print(json.dumps({"measure": "pipelined", "workers": len(workers), "inflight_per_worker": args.inflight,
                              "msgs_per_s": round(rate)}))
            rate = await batched(exp, workers[0], args.messages * 16, 64)
            print(json.dumps({"measure": "batched", "items_per_message": 64, "items_per_s": round(rate)}))
            nbytes = 4 * 1024 * 1024
            mbps = await tensor_rate(exp, workers[0], nbytes, args.tensor_reps)
            copy = memcpy_rate(nbytes, args.tensor_reps * 4)
            print(json.dumps({"measure": "tensor_frame", "bytes": nbytes, "mb_per_s": round(mbps),
                              "memcpy_mb_per_s": round(copy), "ratio": round(mbps / copy, 3)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--tensor-reps", type=int, default=50)
    args = parser.parse_args()
    limit_threads(1)
    run_async(lambda: bench(args))


if __name__ == "__main__":
    main()
