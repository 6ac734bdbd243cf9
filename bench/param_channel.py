"""Parameter channel bandwidth vs a plain memory copy of the same bytes, in one run.

    python bench/param_channel.py [--sizes 10MB,100MB,1GB] [--transports inproc,shm,tcp,disk]

For each size, a publisher process holds a model-like state (float32 matrices, small
biases, a bf16 tensor); this process receives it and materialises it into its own
preallocated "destination model" tensors. One rep is the full path, timed here:

    ask the publisher to publish -> handle back -> receive (views, checksum verified)
    -> copy views into the destination tensors -> (release, not timed)

so shm counts pack into shm + checksum + receiver's verified view + materialising copy.
handoff_s is the rest: the command and handle crossing the pipe and the processes waking.
The first rep (page faults of fresh segments and buffers) is reported as cold_s and left
out of the medians. Right before every rep, a plain memcpy of the same number of bytes is
timed: the faster of torch `dst.copy_(src)` and `np.copyto` over flat preallocated,
prefaulted buffers. memcpy_gb_per_s is the median of those; ratio is the median of the
per-rep ratios, so load from other work on a shared machine cancels out. shm is run
twice: with the default full verification, and with verify=False (trusted same host).
One JSON line per transport and size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from flexmarl.runtime.param_channel import ParamChannel, ParamHandle  # noqa: E402

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
    """Child process: holds the state, publishes on request, releases on request."""
    torch.set_num_threads(1)
    state = model_like_state(total_bytes)
    handles: dict[str, ParamHandle] = {}
    with ParamChannel() as channel:
        conn.send("ready")
        while True:
            cmd, arg = conn.recv()
            if cmd == "publish":
                transport, version = arg
                t0 = time.perf_counter()
                h = channel.publish(state, agent="bench", version=version, transport=transport,
                                    path=os.path.join(disk_dir, f"bench-v{version}.params"))
                publish_s = time.perf_counter() - t0
                handles[h.key] = h
                conn.send_bytes(msgspec.msgpack.encode(h))
                conn.send(publish_s)
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


def run_transport(conn, channel: ParamChannel, transport: str, dst: dict, reps: int, verify: bool,
                  version: int, memcpy: Memcpy) -> dict:
    rows = []
    for rep in range(reps + 1):
        memcpy_s = memcpy.seconds()
        t0 = time.perf_counter()
        conn.send(("publish", (transport, version + rep)))
        handle = msgspec.msgpack.decode(conn.recv_bytes(), type=ParamHandle)
        publish_s = conn.recv()
        t1 = time.perf_counter()
        views = channel.receive(handle, verify=verify)
        t2 = time.perf_counter()
        with torch.no_grad():
            for name, view in views.items():
                dst[name].copy_(view)
        t3 = time.perf_counter()
        del views
        channel.release(handle)
        conn.send(("release", handle.key))
        conn.recv()
        rows.append(dict(total_s=t3 - t0, publish_s=publish_s, handoff_s=t1 - t0 - publish_s, view_s=t2 - t1,
                         materialise_s=t3 - t2, memcpy_s=memcpy_s, ratio=memcpy_s / (t3 - t0)))
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
    args = parser.parse_args()
    torch.set_num_threads(1)
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
                    points = [(t, True) for t in transports if t != "inproc"]
                    points += [("shm", False)] if "shm" in transports else []
                    for i, (transport, verify) in enumerate(points):
                        r = run_transport(parent, channel, transport, dst, reps, verify, 100 * i, memcpy)
                        emit(transport, nbytes, r, verify, reps)
                    if "inproc" in transports:
                        emit("inproc", nbytes, inproc_point(channel, dst, reps, memcpy), True, reps)
            finally:
                parent.send(("stop", None))
                proc.join(30)
                if proc.is_alive():
                    proc.kill()


def inproc_point(channel: ParamChannel, dst: dict, reps: int, memcpy: Memcpy) -> dict:
    """Same process: publish hands over the tensors themselves; the copy is the materialise."""
    state = model_like_state(sum(t.numel() * t.element_size() for t in dst.values()))
    rows = []
    for rep in range(reps + 1):
        memcpy_s = memcpy.seconds()
        t0 = time.perf_counter()
        handle = channel.publish(state, agent="bench", version=rep, transport="inproc")
        t1 = time.perf_counter()
        views = channel.receive(handle)
        t2 = time.perf_counter()
        with torch.no_grad():
            for name, view in views.items():
                dst[name].copy_(view)
        t3 = time.perf_counter()
        channel.release(handle)
        rows.append(dict(total_s=t3 - t0, publish_s=t1 - t0, handoff_s=0.0, view_s=t2 - t1, materialise_s=t3 - t2,
                         memcpy_s=memcpy_s, ratio=memcpy_s / (t3 - t0)))
    return summarise(rows)


def emit(transport: str, nbytes: int, r: dict, verify: bool, reps: int) -> None:
    print(json.dumps({
        "transport": transport, "bytes": nbytes, "verify": verify,
        "gb_per_s": round(nbytes / r["total_s"] / 1e9, 3), "memcpy_gb_per_s": round(nbytes / r["memcpy_s"] / 1e9, 3),
        "ratio": round(r["ratio"], 3), "seconds": round(r["total_s"], 5), "publish_s": round(r["publish_s"], 5),
        "handoff_s": round(r["handoff_s"], 5),
        "view_s": round(r["view_s"], 5), "view_gb_per_s": round(nbytes / max(r["view_s"], 1e-9) / 1e9, 2),
        "materialise_s": round(r["materialise_s"], 5), "cold_s": round(r["cold_s"], 4), "reps": reps,
    }), flush=True)


if __name__ == "__main__":
    main()
