"""Parameter channel bandwidth vs a plain memory copy of the same bytes, in one run.

    python bench/micro/param_channel.py [--sizes 10MB,100MB,1GB] [--transports inproc,shm,tcp,disk]
    python bench/micro/param_channel.py --weight-sync-steps 15 [--set key=value ...]

For each size, a publisher process holds a model-like state (float32 matrices, small
biases, a bf16 tensor); this process receives it into its own preallocated "destination
model" tensors. One rep is the full path, timed here:

    ask the publisher to publish -> handle back -> receive_into(destination)
    -> (release, not timed)

The publisher holds the state either as ordinary tensors, which publish packs into the
transport's buffer (a copy plus a checksum), or in a SharedBucket, which publish over shm
seals in place (a checksum, no copy). The receiver either verifies the checksum and then
copies ("atomic": a corrupt transfer leaves the destination untouched), verifies while
copying ("fused": one pass; a corrupt transfer spoils the destination, for one that is
built to be replaced), or skips verification ("unverified", for comparison).
handoff_s is the command and handle crossing the pipe and the processes waking.

The first rep (page faults of fresh segments and buffers) is reported as cold_s and left
out of the medians. Right before every rep, a plain memcpy of the same number of bytes is
timed: the faster of torch `dst.copy_(src)` and `np.copyto` over flat preallocated,
prefaulted buffers. memcpy_gb_per_s is the median of those; ratio is the median of the
per-rep ratios, so load from other work on a shared machine cancels out. One JSON line
per transport, mode and size.

--weight-sync-steps N instead runs the default job for N steps (real workers, vLLM
engines) and prints, per agent, the median weight-sync latency (trainer publish, then
every rollout instance loading the weights into vLLM, control messages included) read
from the run's WeightSyncFinished events, leaving out the first sync of each agent.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from flexmarl.runtime.params.channel import ParamChannel, ParamHandle  # noqa: E402

UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}


def model_like_state(total_bytes: int, *, materialise: bool = True) -> dict[str, torch.Tensor]:
    """16 float32 matrices, 16 biases and one bf16 embedding, about total_bytes in all."""
    hidden = 1024
    rows = max(1, (total_bytes - 16 * hidden * 4) // (17 * hidden * 4))
    state = {}
    for i in range(16):
        state[f"layers.{i}.weight"] = torch.empty(rows, hidden)
        state[f"layers.{i}.bias"] = torch.empty(hidden)
    state["embed.weight"] = torch.empty(rows, 2 * hidden, dtype=torch.bfloat16)
    if materialise:
        gen = torch.Generator().manual_seed(0)
        for t in state.values():
            t.view(-1).view(torch.uint8).random_(0, 256, generator=gen)
    return state


def publisher_main(conn, total_bytes: int, disk_dir: str) -> None:
    """Child process: holds the state, publishes on request, releases on request.

    The state is held twice: as ordinary tensors, and in a SharedBucket, as a trainer
    whose parameters live in shared memory holds it. Before each bucket publish it makes
    a training-like write (prepare_write, then one in-place update), so a copy-on-write
    would show up in publish_s; the bench releases every publication before the next, so
    none should happen, and the reply says how many did."""
    torch.set_num_threads(1)
    state = model_like_state(total_bytes)
    handles: dict[str, ParamHandle] = {}
    with ParamChannel() as channel:
        bucket = channel.shared_bucket(state)
        conn.send("ready")
        while True:
            cmd, arg = conn.recv()
            if cmd == "publish":
                transport, version, from_bucket = arg
                if from_bucket:
                    bucket.prepare_write()
                    bucket.tensors["layers.0.bias"].add_(1.0)
                t0 = time.perf_counter()
                h = channel.publish(bucket if from_bucket else state, agent="bench", version=version,
                                    transport=transport, path=os.path.join(disk_dir, f"bench-v{version}.params"))
                publish_s = time.perf_counter() - t0
                handles[h.key] = h
                conn.send_bytes(msgspec.msgpack.encode(h))
                conn.send((publish_s, bucket.moves))
            elif cmd == "release":
                channel.release(handles.pop(arg))
                conn.send("ok")
            else:
                break


class Memcpy:
    """The baseline: one plain copy of `nbytes` between flat, prefaulted buffers."""

    def __init__(self, nbytes: int):
        self.src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.dst.copy_(self.src)

    def seconds(self) -> float:
        """The faster of torch and numpy (both end in a vectorised copy; either may win)."""
        best = float("inf")
        for copy in (lambda: self.dst.copy_(self.src), lambda: np.copyto(self.dst.numpy(), self.src.numpy())):
            t0 = time.perf_counter()
            copy()
            best = min(best, time.perf_counter() - t0)
        return best


def run_transport(conn, channel: ParamChannel, point: Point, dst: dict, reps: int, version: int,
                  memcpy: Memcpy) -> dict:
    rows = []
    for rep in range(reps + 1):
        memcpy_s = memcpy.seconds()
        t0 = time.perf_counter()
        conn.send(("publish", (point.transport, version + rep, point.publisher == "bucket")))
        handle = msgspec.msgpack.decode(conn.recv_bytes(), type=ParamHandle)
        publish_s, moves = conn.recv()
        t1 = time.perf_counter()
        channel.receive_into(handle, dst, verify=point.receive != "unverified", atomic=point.receive != "fused")
        t2 = time.perf_counter()
        channel.release(handle)
        conn.send(("release", handle.key))
        conn.recv()
        rows.append(dict(total_s=t2 - t0, publish_s=publish_s, handoff_s=t1 - t0 - publish_s, receive_s=t2 - t1,
                         memcpy_s=memcpy_s, ratio=memcpy_s / (t2 - t0), moves=moves))
    return summarise(rows)


def summarise(rows: list[dict]) -> dict:
    steady = rows[1:]
    result = {key: statistics.median(r[key] for r in steady) for key in steady[0]}
    result["cold_s"] = rows[0]["total_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10MB,100MB,1GB", help="comma-separated, e.g. 10MB,100MB,1GB")
    parser.add_argument("--transports", default="inproc,shm,tcp,disk")
    parser.add_argument("--reps", type=int, default=0, help="steady-state reps per point (default: 9/5/3 by size)")
    parser.add_argument("--disk-dir", default="/tmp", help="where disk buckets are written (a real disk, not tmpfs)")
    parser.add_argument("--weight-sync-steps", type=int, default=0,
                        help="measure the default job's weight-sync latency over this many steps instead")
    parser.add_argument("--set", action="append", default=[], help="config override for --weight-sync-steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.weight_sync_steps:
        weight_sync_latency(args.weight_sync_steps, args.set)
        return
    sizes = [int(float(s[:-2]) * UNITS[s[-2:].upper()]) for s in args.sizes.split(",")]
    transports = args.transports.split(",")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="flexmarl-bench-", dir=args.disk_dir) as disk_dir:
        for size in sizes:
            reps = args.reps or (9 if size <= 10**7 else 5 if size <= 10**8 else 3)
            dst = model_like_state(size, materialise=False)
            for t in dst.values():
                t.zero_()  # fault the destination in now, as a live model's parameters would be
            nbytes = sum(t.numel() * t.element_size() for t in dst.values())
            memcpy = Memcpy(nbytes)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=publisher_main, args=(child, size, disk_dir), daemon=True)
            proc.start()
            try:
                assert parent.recv() == "ready"
                with ParamChannel() as channel:
                    for i, point in enumerate(points_for(transports)):
                        emit(point, nbytes, run_transport(parent, channel, point, dst, reps, 100 * i, memcpy), reps)
                    if "inproc" in transports:
                        emit(Point("inproc", "tensors", "atomic"), nbytes,
                             inproc_point(channel, dst, reps, memcpy), reps)
            finally:
                parent.send(("stop", None))
                proc.join(30)
                if proc.is_alive():
                    proc.kill()


class Point(NamedTuple):
    transport: str
    publisher: str  # "tensors": ordinary tensors, packed on publish; "bucket": a SharedBucket
    receive: str  # "atomic": verified, then copied; "fused": verified while copying; "unverified"


def points_for(transports: list[str]) -> list[Point]:
    points = []
    for t in transports:
        if t == "shm":
            points += [Point("shm", "tensors", "atomic"), Point("shm", "tensors", "unverified"),
                       Point("shm", "bucket", "atomic"), Point("shm", "bucket", "fused")]
        elif t != "inproc":
            points.append(Point(t, "tensors", "atomic"))
    return points


def inproc_point(channel: ParamChannel, dst: dict, reps: int, memcpy: Memcpy) -> dict:
    """Same process: publish hands over the tensors themselves; the copy is the receive."""
    state = model_like_state(sum(t.numel() * t.element_size() for t in dst.values()))
    rows = []
    for rep in range(reps + 1):
        memcpy_s = memcpy.seconds()
        t0 = time.perf_counter()
        handle = channel.publish(state, agent="bench", version=rep, transport="inproc")
        t1 = time.perf_counter()
        channel.receive_into(handle, dst)
        t2 = time.perf_counter()
        channel.release(handle)
        rows.append(dict(total_s=t2 - t0, publish_s=t1 - t0, handoff_s=0.0, receive_s=t2 - t1,
                         memcpy_s=memcpy_s, ratio=memcpy_s / (t2 - t0), moves=0))
    return summarise(rows)


def emit(point: Point, nbytes: int, r: dict, reps: int) -> None:
    print(json.dumps({
        "transport": point.transport, "bytes": nbytes, "publisher": point.publisher, "receive": point.receive,
        "gb_per_s": round(nbytes / r["total_s"] / 1e9, 3), "memcpy_gb_per_s": round(nbytes / r["memcpy_s"] / 1e9, 3),
        "ratio": round(r["ratio"], 3), "seconds": round(r["total_s"], 5), "publish_s": round(r["publish_s"], 5),
        "handoff_s": round(r["handoff_s"], 5), "receive_s": round(r["receive_s"], 5),
        "cold_s": round(r["cold_s"], 4), "copy_on_write_moves": int(r["moves"]), "reps": reps,
    }), flush=True)


def weight_sync_latency(steps: int, overrides: list[str]) -> None:
    import asyncio

    from flexmarl.controller import Experiment
    from flexmarl.controller.tasks.digit_chain import default_config
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.config import load_config
    from flexmarl.runtime.eventlog import read_events

    cfg = load_config(None, [f"run.steps={steps}", "run.progress=false", *overrides], defaults=default_config())
    with tempfile.TemporaryDirectory() as run_dir:
        async def run() -> None:
            async with Experiment(cfg, run_dir=run_dir) as exp:
                await exp.train()

        asyncio.run(run())
        events, problem = read_events(os.path.join(run_dir, "events.log"))
    if problem is not None:
        raise SystemExit(f"the run's event log is damaged: {problem}")
    syncs: dict[str, list] = {}
    for e in events:
        if isinstance(e, ev.WeightSyncFinished):
            syncs.setdefault(e.agent, []).append(e)
    for agent, done in syncs.items():
        steady = done[1:] or done  # the first sync of an agent pays one-time costs
        print(json.dumps({"measure": "weight_sync", "agent": agent, "bytes": steady[-1].nbytes,
                          "median_s": round(statistics.median(e.seconds for e in steady), 5),
                          "min_s": round(min(e.seconds for e in steady), 5), "syncs": len(steady)}), flush=True)


if __name__ == "__main__":
    main()
