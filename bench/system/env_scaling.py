"""Rewards that cost CPU: in the controller (as without environment workers) or on 1, 2, 4
environment workers.

The controller side is the real one: a `ControllerServer` and the `EnvClient` (what
`ctx.call` uses with `cluster.env_workers`), in this process, on uvloop; the environment
workers are real `flexmarl worker --role env` processes started by the local launcher, one
pool process each (`env.processes = 1`), so workers = processes burning. Without workers,
calls run in the controller's tool pool (`pipeline.tool_threads` = 4 threads), as
`ctx.call` does then. Episodes (16 at once, `pipeline.max_concurrent_episodes`) each
reward a group of 8 samples, one call per sample, concurrently; each call burns `ms`
milliseconds of its thread's CPU (a busy loop on `time.thread_time`). Per point:

    samples_s          rewarded samples per second
    lag_p99_ms         the controller's event-loop lag: how late a 10 ms sleep wakes, 99th percentile
    ctl_cpu_us_sample  the controller process's CPU (all threads) per sample, in us, net of
                       what it spends idle (`ctl_idle_cpu_frac`, measured for a second just
                       before, in the same process: heartbeats, the lag probe, ZeroMQ's I/O
                       thread), so a slower point is not charged more idle time per sample:
                       with workers it must not grow with the reward's cost (routing and
                       counting only); without, it holds the reward itself
    ctl_cpu_frac       the controller's CPU seconds over the point's wall seconds (1.0: a core)
    ideal_s            samples/s if every core the point can use burned rewards and nothing
                       else: min(workers or 1, cores) * 1000 / ms (the tool pool's threads share
                       one interpreter lock: one core)

    .venv/bin/python bench/system/env_scaling.py                      # 1, 5, 20 ms x 0, 1, 2, 4 workers
    .venv/bin/python bench/system/env_scaling.py --costs 1 --workers 0,1 --seconds 1   # a smoke run

Each point runs for about `--seconds`; worker sets are started once per count and reused
for every cost. On a 2-core machine the scaling ends at the cores: 4 workers cannot beat
2, and the controller's own process shares the cores with them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GROUP = 8  # samples per episode, each rewarded by one call
EPISODES_AT_ONCE = 16  # pipeline.max_concurrent_episodes
TOOL_THREADS = 4  # pipeline.tool_threads
IDLE_S = 1.0  # the controller's idle CPU is measured this long before each point


async def episode(ctx) -> None:  # the module is the workflow the environment workers import
    pass


def burn(ms: float, sample: int) -> float:
    """The reward: `ms` milliseconds of this thread's CPU, then a number."""
    end = time.thread_time() + ms / 1000.0
    x = 0
    while time.thread_time() < end:
        x += 1
    return float(sample % 2)


async def lag_probe(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        await asyncio.sleep(0.01)
        lags.append(time.monotonic() - t0 - 0.01)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_point(call, ms: float, seconds: float, workers: int) -> dict:
    """Episodes until `seconds` have passed; the point's figures."""
    samples = max(GROUP * EPISODES_AT_ONCE, int(seconds * 1000 / ms * max(workers, 1)))
    episodes = -(-samples // GROUP)
    limit = asyncio.Semaphore(EPISODES_AT_ONCE)

    async def one(e: int) -> None:
        async with limit:
            await asyncio.gather(*(call(ms, e * GROUP + i) for i in range(GROUP)))

    await asyncio.gather(*(one(e) for e in range(2)))  # warm: every process has run once
    lags: list[float] = []
    stop = asyncio.Event()
    probe = asyncio.create_task(lag_probe(lags, stop))
    cpu0, t0 = cpu_seconds(), time.monotonic()
    await asyncio.sleep(IDLE_S)
    idle_frac = (cpu_seconds() - cpu0) / (time.monotonic() - t0)
    lags.clear()
    cpu0, t0 = cpu_seconds(), time.monotonic()
    await asyncio.gather(*(one(e) for e in range(episodes)))
    wall, cpu = time.monotonic() - t0, cpu_seconds() - cpu0
    stop.set()
    await probe
    done = episodes * GROUP
    cores = os.cpu_count() or 1
    return {"ms": ms, "workers": workers, "samples": done, "wall_s": round(wall, 2),
            "samples_s": round(done / wall, 1), "ideal_s": round(min(max(workers, 1), cores) * 1000 / ms, 1),
            "lag_p99_ms": round(1000 * statistics.quantiles(lags, n=100)[98], 2) if len(lags) > 2 else None,
            "ctl_cpu_us_sample": round(1e6 * (cpu - idle_frac * wall) / done, 1),
            "ctl_cpu_frac": round(cpu / wall, 3), "ctl_idle_cpu_frac": round(idle_frac, 4)}


async def in_controller(module, costs: list[float], seconds: float) -> list[dict]:
    from flexmarl.controller.environments.local import run_here

    pool = concurrent.futures.ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="tool")
    try:
        return [await run_point(lambda ms, i: run_here(pool, module.burn, (ms, i), {}, 600.0), ms, seconds, 0)
                for ms in costs]
    finally:
        pool.shutdown(wait=True)


async def on_workers(module, count: int, costs: list[float], seconds: float, log_dir: Path) -> list[dict]:
    from flexmarl.controller.control.server import ControllerServer
    from flexmarl.controller.environments.client import EnvClient
    from flexmarl.controller.launch.launcher import LocalWorkers
    from flexmarl.runtime.config import EnvConfig, TransportConfig

    server = ControllerServer(TransportConfig())
    address = server.bind()
    loops = [asyncio.create_task(server.serve()), asyncio.create_task(server.heartbeat())]
    workers = LocalWorkers(address, log_dir)
    try:
        for i in range(count):
            workers.start("env", f"env-{i}")
        await server.wait_for_workers({"env": count}, 300)
        client = EnvClient(server, f"{module.__file__}:episode", EnvConfig(processes=1))
        await client.start([f"env-{i}" for i in range(count)])
        rows = [await run_point(lambda ms, i: client.call(module.burn, (ms, i), {}, 600.0), ms, seconds, count)
                for ms in costs]
        await client.close()
        return rows
    finally:
        await server.shut_down_workers("bench done", 10)
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        server.close()
        await asyncio.to_thread(workers.stop, 10.0)


def table(rows: list[dict]) -> str:
    lines = ["| reward ms | env workers | samples/s | ideal | loop lag p99 ms | controller CPU us/sample | "
             "controller CPU (cores) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ms']:g} | {r['workers'] or 'none (in the controller)'} | {r['samples_s']} | "
                     f"{r['ideal_s']} | {r['lag_p99_ms']} | {r['ctl_cpu_us_sample']} | {r['ctl_cpu_frac']} |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    from flexmarl.runtime.user_modules import import_file

    # Imported as a workflow file is, so its functions travel by the name the workers import it under.
    module = import_file(Path(__file__), "flexmarl_workflow")
    rows = []
    with tempfile.TemporaryDirectory(prefix="env-scaling-") as logs:
        for count in args.workers:
            if count == 0:
                part = await in_controller(module, args.costs, args.seconds)
            else:
                part = await on_workers(module, count, args.costs, args.seconds, Path(logs))
            for row in part:
                print(json.dumps(row), flush=True)
            rows += part
    rows.sort(key=lambda r: (r["ms"], r["workers"]))
    print(table(rows))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", default="1,5,20", help="CPU milliseconds per reward, comma-separated")
    parser.add_argument("--workers", default="0,1,2,4", help="environment worker counts (0: in the controller)")
    parser.add_argument("--seconds", type=float, default=4.0, help="about how long each point runs")
    args = parser.parse_args(argv)
    args.costs = [float(c) for c in args.costs.split(",")]
    args.workers = [int(w) for w in args.workers.split(",")]
    return args


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from flexmarl.runtime.aio import run_async, setup_logging

    setup_logging("WARNING")
    run_async(lambda: main(parse()))
