"""One real controller at cluster scale: how many samples per second it carries, at what cost.

The controller is the real one (`Experiment`, what `flexmarl run` runs: server, store,
router, pipelines, allocator, weight sync, event log), in this process, on uvloop. The
workers are fakes (controller/testing/fake_cluster.py) speaking the real protocol over real ZeroMQ
sockets, many to a helper process, answering after modelled delays; weights are handles.

Each point of the sweep runs in a fresh process (so memory figures are its own) and prints
one JSON row; the sweep prints the rows and a table. Per point:

    samples_s        samples trained per second, first step's start to last sync's end
    cpu_us_sample    the controller process's CPU seconds (all threads) per sample, in us
    cpu_frac         those CPU seconds over the wall seconds (1.0 = one core, saturated)
    loop_cpu_frac    the event loop's own thread's CPU seconds over the wall seconds (the rest
                     of cpu_frac is ZeroMQ's I/O thread and the event log's writer)
    loop_runq_frac   the seconds the loop's thread was ready to run but waited for a core
                     (Linux schedstat), over the wall seconds: what the machine's other
                     processes (here the fake cluster on the same 2 cores) take from it
    cluster_cpu_frac the fake cluster's helper processes' CPU seconds over the wall seconds,
                     per core they may run on (1.0 = their cores saturated: the fakes, not
                     the controller, set the pace)
    cluster_cpu_s    the same CPU seconds, unscaled
    cluster_runq_frac  the seconds their threads were ready to run but waited for a core,
                     over the wall seconds, per core: what other processes took from them
    lag_p50/p99_ms   event-loop lag: how late a 10 ms sleep wakes up
    log_mb_s         event-log bytes written per second
    rss_mb           the controller's peak resident memory
    rollout_busy     mean busy fraction of the fake engines (their modelled seconds)
    rollout_busy_max the busiest engine's: near 1.0, an agent with too few instances sets the pace
    instances_min/max  the fewest and most instances an agent has at the end (the initial
                     placement, `router.placement`: a point's "placement", "chain" unless
                     given; then, after the first step, `router.measured_placement`: a
                     point's "measured", true unless given)
    instances_moved  instances moved between agents (by `router.measured_placement`)
    capacity_s       samples/s the fake engines could produce at their modelled rate
    generate_per_sample  (with --replay) GENERATE messages sent per sample trained
    replay_*         (with --replay) `flexmarl replay --check` on the point's log: read,
                     summary and check in this process, and the command in a fresh one
                     (replay_cli_s), over the training window and over the whole run (run_s)
    waited           "yes" when the fake cluster idled waiting on the controller: the
                     controller's loop was saturated (cpu_frac >= WAITED_CPU) while the
                     engines were busy less than 90% of the time
    accounting       every sample trained exactly once: the controller's counts, the fake
                     trainers' and the fakes' refusals (a sample sent twice is refused) agree

    .venv/bin/python bench/system/controller_scale.py                  # the sweep
    .venv/bin/python bench/system/controller_scale.py --smoke          # one tiny point
    .venv/bin/python bench/system/controller_scale.py --point '{"instances": 1024, "agents": 32, ...}' \
        [--replay] [--profile FILE.prof]
    .venv/bin/python bench/system/controller_scale.py --by-module FILE.prof  # a profile's time by module

A point with `"pin": true` (every point of a sweep with `--pin`) gives the controller a
core of its own (its process, all threads, on the first core; the fake cluster on the
others, in one helper process per core, each with its share of the rollout and trainer
workers: more helpers than cores only take turns on them), as a controller on a host of
its own would have. Unpinned, the helpers hold WORKERS_PER_HELPER rollout workers each,
and the trainers one more.

The fake cluster must not be what sets the pace: `cluster_cpu_frac` says how much of its
cores it used. Its per-message cost is the real worker session's (workers/session.py) and
socket's (runtime/transport.py) plus the fakes' own replies (fake_cluster.py): a watch of
the loop per process, not per session, and a socket that reads and writes the plain libzmq
socket took it from 86 us of CPU per sample (wide, 1,024 x 32, pinned; one run, load 9)
to 40-44 (two runs, load 16-19), changing nothing the controller receives; the
controller's collector policy in the helper (`collector.swept`) from 25.7-32.2 to 22.9-27.6
(means of three runs, chain and wide; RESULTS run V), where the wide point had been paced by it.

The machine here has 2 cores: the controller gets about one, the helpers share the other,
so absolute figures are this machine's; compare points within one sweep.

A point's window at the default 4 steps lasts 1-3 s at 1,024 instances: it ends before a
long run's steady state (the collector's first sweep, 5 s after the workers joined, which
sets its young passes). Add `"steps": 60` to a point for a window of 20-45 s (RESULTS, run W).

The wide shape asks every agent alike, but a point places instances as `flexmarl run` does
by default (`router.placement = "chain"`, weighing later agents more): at 1,024 x 32 agent00
gets 2 instances and agent31 62, and while that lasts agent00's two (`rollout_busy_max`) set
the pace, not the controller (RESULTS, run X). After the first step the run places them
again by the tokens each agent was sent (`router.measured_placement`, 32 each); add
`"measured": false` to keep the first placement, `"placement": "parallel"` to start from
every agent's share.

A point's groups are tiny (1-6 output tokens, 2-4 samples): the groups of one agent routed
in one loop turn share an instance and a message while within `router.coalesce_tokens`
(256) of the least-loaded pick; add `"coalesce": 0` to route every group by the rule alone.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flexmarl.controller.run.experiment import Experiment
from flexmarl.runtime.aio import run_async
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import segment_paths
from flexmarl.controller.testing import fake_cluster

WORKERS_PER_HELPER = 256
# The controller's loop counts as what the fake cluster waits on when it keeps this much of
# a core busy while the engines idle (on 2 shared cores it never quite reaches 1.0).
WAITED_CPU = 0.75
DEFAULTS = {"steps": 4, "micro_batch": 64, "mode": "sync", "k": 0, "shape": "chain", "placement": "chain",
            "measured": True}

# instances, agents, trainers, shape, mode, K
SWEEP = [
    (64, 4, 8, "chain", "sync", 0),
    (64, 4, 8, "chain", "async", 0),
    (64, 4, 8, "chain", "async", 2),
    (256, 8, 16, "chain", "async", 2),
    (512, 16, 32, "chain", "async", 2),
    (1024, 32, 64, "chain", "sync", 0),
    (1024, 32, 64, "chain", "async", 0),
    (1024, 32, 64, "chain", "async", 2),
    (1024, 32, 64, "wide", "sync", 0),
    (1024, 32, 64, "wide", "async", 2),
]


def complete(point: dict[str, Any]) -> dict[str, Any]:
    p = {**DEFAULTS, **point}
    samples_per_query = 52 if p["shape"] == "chain" else 4 * p["agents"]
    # Enough episodes per batch that every instance has work: about 12 samples each.
    p.setdefault("queries", max(4, 12 * p["instances"] // samples_per_query))
    return p


def config_for(p: dict[str, Any], run_dir: Path, address: str, model_dir: Path) -> Any:
    fn, agents_of = fake_cluster.WORKFLOWS[p["shape"]]
    agents = {a: {**c, "model": str(model_dir), "lr": 1e-3, "ignore_eos": True} for a, c in agents_of(p["agents"]).items()}
    return load_config(defaults={
        "run": {"workflow": f"{fake_cluster.__name__}:{fn}", "steps": p["steps"], "out": str(run_dir),
                "progress": False, "checkpoint_every": 0, "event_log": True},
        "transport": {"address": address, "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 30.0},
        "cluster": {"rollout_workers": p["instances"], "trainer_workers": p["trainers"],
                    "worker_start_timeout_s": 120.0},
        "pipeline": {"mode": p["mode"], "max_staleness": p["k"], "queries_per_step": p["queries"],
                     "micro_batch": p["micro_batch"], "max_concurrent_episodes": p["queries"],
                     # a step's episodes reach only some of many agents: the others step on nothing
                     "allow_empty_steps": True},
        "router": {"placement": p["placement"], "measured_placement": p["measured"],
                   **({"coalesce_tokens": p["coalesce"]} if "coalesce" in p else {})},
        "agents": agents,
    })


def split_cores() -> tuple[set[int], set[int]]:
    """A core for the controller and the others for the fake cluster (`"pin": true`)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("pinning needs at least 2 cores")
    return {cores[0]}, set(cores[1:])


def helper_workers(p: dict[str, Any], cluster_cores: set[int] | None = None) -> list[list[tuple[str, str]]]:
    """The fake workers each helper process runs: pinned, one helper per core of the
    cluster's, each with its share of every worker (more helpers than cores would only take
    turns on them); unpinned, WORKERS_PER_HELPER rollout workers to a helper and one more
    helper for the trainers."""
    rollout = [("rollout", f"rollout-{i:04d}") for i in range(p["instances"])]
    trainers = [("trainer", f"trainer-{i:02d}") for i in range(p["trainers"])]
    if cluster_cores:
        workers = rollout + trainers
        return [workers[i::len(cluster_cores)] for i in range(len(cluster_cores))]
    return [rollout[i:i + WORKERS_PER_HELPER] for i in range(0, len(rollout), WORKERS_PER_HELPER)] + [trainers]


def start_helpers(p: dict[str, Any], address: str, root: Path,
                  cluster_cores: set[int] | None = None) -> list[tuple[subprocess.Popen, Path]]:
    helpers = []
    for n, workers in enumerate(helper_workers(p, cluster_cores)):
        out = root / f"helper-{n}.json"
        spec = {"address": address, "workers": workers, "out": str(out), "costs": p.get("costs", {}),
                "transport": {"heartbeat_timeout_s": 30.0, "handshake_timeout_s": 120.0, "reconnect_timeout_s": 0.0}}
        log = open(root / f"helper-{n}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", fake_cluster.__name__, json.dumps(spec)],
                                stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cluster_cores)) if cluster_cores else None)
        helpers.append((proc, out))
    return helpers


def stop_helpers(helpers: list[tuple[subprocess.Popen, Path]], timeout: float = 60.0) -> list[dict[str, Any]]:
    reports = []
    deadline = time.monotonic() + timeout
    for proc, out in helpers:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by its handle
            proc.wait()
        if out.exists():
            reports += json.loads(out.read_text())
    return reports


def log_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in segment_paths(path)) if path.exists() else 0


def runq_seconds() -> float:
    """Seconds this thread has waited, ready to run, for a core (0.0 where Linux does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def process_cpu(pids: list[int]) -> float:
    """The CPU seconds (all threads) the processes have used so far: Linux schedstat's time on
    a core, in nanoseconds (/proc/PID/stat counts clock ticks, 10 ms: a smoke point's window
    of a few tens of milliseconds read 0 there about every other run); user and system ticks
    where the kernel keeps no schedstat."""
    if not os.path.exists("/proc/self/schedstat"):
        return sum(_ticks(pid) for pid in pids)
    return _schedstat(pids, 0)


def _ticks(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0


def process_runq(pids: list[int]) -> float:
    """The seconds the processes' threads have waited, ready to run, for a core (Linux schedstat)."""
    return _schedstat(pids, 1)


def _schedstat(pids: list[int], field: int) -> float:
    """A schedstat field (0: time on a core, 1: time waiting for one), in seconds, summed
    over every thread of the processes; an ended process or thread counts nothing."""
    total = 0.0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[field]) / 1e9
            except (OSError, IndexError, ValueError):
                continue
    return total


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Watch:
    """Samples the controller while it trains: loop lag, CPU and log bytes between the
    first step's start and the moment every batch is trained and synced (and profiles that
    window alone when given a profiler: no set-up, no teardown)."""

    def __init__(self, exp: Experiment, period: float = 0.01, profiler: Any = None,
                 helpers: list[int] = ()) -> None:
        self.exp = exp
        self.helpers = list(helpers)
        self.cluster_cpu = self.cluster_runq = 0.0  # the helper processes' CPU and run-queue seconds in the window
        self.period = period
        self.profiler = profiler
        self.lags: list[float] = []
        self.t0 = self.t1 = self.cpu0 = self.cpu1 = 0.0
        self.loop_cpu = self.loop_runq = 0.0  # the loop thread's CPU and run-queue seconds
        self.log0 = self.log1 = 0
        self.gc_s = 0.0  # seconds in the garbage collector while watching
        self.gc_full = 0  # full (generation 2) collections among them
        self._gc_t = 0.0

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self.t0 and not self.t1:
            self.gc_s += time.perf_counter() - self._gc_t
            self.gc_full += info["generation"] == 2

    async def run(self) -> None:
        gc.callbacks.append(self._gc)
        try:
            await self._watch()
        finally:
            gc.callbacks.remove(self._gc)

    async def _watch(self) -> None:
        training = self.exp.training
        while not training.started:
            await asyncio.sleep(0.005)
        log = self.exp.run_dir / "events.log"
        self.t0, self.cpu0, self.log0 = time.monotonic(), time.process_time(), log_bytes(log)
        thread_cpu0, runq0, cluster0 = time.thread_time(), runq_seconds(), process_cpu(self.helpers)
        cluster_runq0 = process_runq(self.helpers)
        if self.profiler is not None:
            self.profiler.enable()
        while not training.parts.schedule.finished:
            t = time.perf_counter()
            await asyncio.sleep(self.period)
            self.lags.append(time.perf_counter() - t - self.period)
        if self.profiler is not None:
            self.profiler.disable()
        self.t1, self.cpu1 = time.monotonic(), time.process_time()
        self.loop_cpu, self.loop_runq = time.thread_time() - thread_cpu0, runq_seconds() - runq0
        self.cluster_cpu = process_cpu(self.helpers) - cluster0
        self.cluster_runq = process_runq(self.helpers) - cluster_runq0
        await self.exp.flush_events()
        self.log1 = log_bytes(log)


async def run_point(p: dict[str, Any], root: Path, profile: str = "") -> dict[str, Any]:
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    address = f"ipc://{root}/controller.sock"
    cfg = config_for(p, root / "run", address, model_dir)
    cluster_cores = None
    if p.get("pin"):  # before the controller makes its threads: they inherit it
        controller_cores, cluster_cores = split_cores()
        os.sched_setaffinity(0, controller_cores)
    helpers = start_helpers(p, address, root, cluster_cores)
    profiler = None
    if profile:
        import cProfile
        # The loop thread's CPU clock: on a shared machine a wall clock counts a call that
        # lost its core as the call's own time.
        profiler = cProfile.Profile(time.thread_time)
    began = time.perf_counter()
    try:
        async with Experiment(cfg, run_dir=root / "run", spawn_workers=False) as exp:
            watch = Watch(exp, profiler=profiler, helpers=[proc.pid for proc, _ in helpers])
            watcher = asyncio.create_task(watch.run(), name="watch")
            summary = await exp.train()
            await watcher
            if profiler is not None:
                profiler.dump_stats(profile)
            training = exp.training
        run_s = time.perf_counter() - began
    finally:
        reports = stop_helpers(helpers)
    cores = len(cluster_cores) if cluster_cores else len(os.sched_getaffinity(0))
    return {**measure(p, cfg, training, summary, watch, reports, cores), "run_s": round(run_s, 3)}


def measure(p: dict[str, Any], cfg: Any, training: Any, summary: Any, watch: Watch,
            reports: list[dict[str, Any]], cluster_cores: int = 1) -> dict[str, Any]:
    wall = watch.t1 - watch.t0
    samples = summary.samples
    cpu = watch.cpu1 - watch.cpu0
    # The run's busy fractions are over its whole wall time (teardown included): as seconds, over ours.
    busy = {w: f * training.wall_s / wall for w, f in training.busy.items()} if wall else {}
    rollout_busy = [v for w, v in busy.items() if w.startswith("rollout")]
    trainer_busy = [v for w, v in busy.items() if w.startswith("trainer")]
    costs = {**fake_cluster.DEFAULT_COSTS, **p.get("costs", {})}
    agents = cfg.agents
    store = training.parts.store
    generated = sum(store.count(a, "generated") for a in agents)
    dropped = sum(store.count(a, "dropped") for a in agents)
    per_agent = {a: training.parts.pipelines[a].samples_trained for a in agents}
    at_trainers = {a: 0 for a in agents}
    errors = []
    for r in reports:
        errors += r["errors"]
        if r["role"] == "trainer":
            for a, n in r["samples"].items():
                at_trainers[a] += n
    tokens_per_sample = sum(c.max_tokens * c.group_size for c in agents.values()) / sum(
        c.group_size for c in agents.values())
    cpu_frac = cpu / wall if wall else 0.0
    mean_busy = sum(rollout_busy) / len(rollout_busy) if rollout_busy else 0.0
    served = [len(training.parts.instances.instances(a)) for a in agents]
    return {
        **{k: p[k] for k in ("instances", "agents", "trainers", "shape", "mode", "k", "queries", "steps", "placement",
                                  "measured")},
        **({"coalesce": p["coalesce"]} if "coalesce" in p else {}),
        "samples": samples,
        "wall_s": round(wall, 3),
        "samples_s": round(samples / wall) if wall else 0,
        "cpu_us_sample": round(cpu / samples * 1e6, 1) if samples else None,
        "cpu_frac": round(cpu_frac, 2),
        "loop_cpu_frac": round(watch.loop_cpu / wall, 2) if wall else 0.0,
        "loop_runq_frac": round(watch.loop_runq / wall, 2) if wall else 0.0,
        "cluster_cpu_frac": round(watch.cluster_cpu / wall / cluster_cores, 2) if wall else 0.0,
        "cluster_cpu_s": round(watch.cluster_cpu, 3),
        "cluster_runq_frac": round(watch.cluster_runq / wall / cluster_cores, 2) if wall else 0.0,
        "lag_p50_ms": round(1e3 * percentile(watch.lags, 0.5), 2),
        "lag_p99_ms": round(1e3 * percentile(watch.lags, 0.99), 2),
        "gc_s": round(watch.gc_s, 2),
        "gc_full": watch.gc_full,
        "log_mb_s": round((watch.log1 - watch.log0) / wall / 1e6, 2) if wall else 0.0,
        "log_mb": round(watch.log1 / 1e6, 2),
        "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rollout_busy": round(mean_busy, 3),
        "rollout_busy_max": round(max(rollout_busy, default=0.0), 3),
        "instances_min": min(served), "instances_max": max(served),
        "instances_moved": sum(r is not None for r in training.reassignments),
        "trainer_busy": round(sum(trainer_busy) / len(trainer_busy), 3) if trainer_busy else 0.0,
        "capacity_s": round(p["instances"] * costs["tokens_per_s"] / tokens_per_sample),
        "waited": "yes" if cpu_frac >= WAITED_CPU and mean_busy < 0.9 else "no",
        "generated": generated,
        "dropped": dropped,
        "accounting": bool(not errors and per_agent == at_trainers and samples + dropped == generated
                           and samples == p["steps"] * p["queries"] * (52 if p["shape"] == "chain" else 4 * p["agents"])),
        "fake_errors": errors[:3],
        "episodes_failed": summary.episodes_failed,
        "events_log": str(training.run_dir / "events.log"),
    }


def time_replay(path: str, wall_s: float, run_s: float) -> dict[str, Any]:
    """`flexmarl replay --check` on the log, in this process, timed by parts; then the
    command itself, as a user runs it (a fresh process: imports, printing and all), over
    the training window (`wall_s`) and over the whole run (`run_s`: the controller's
    start to its end, workers' registration and shutdown included)."""
    from flexmarl.controller import replay
    from flexmarl.runtime.eventlog import read_events

    gc.collect()  # the run's garbage is the run's, not the replay's
    t0 = time.perf_counter()
    events, problem = read_events(path)
    t1 = time.perf_counter()
    summary = replay.summarize(events)
    t2 = time.perf_counter()
    diff = replay.check(events)
    t3 = time.perf_counter()
    # GENERATE messages: one per (instance, request id), whatever agents' groups it carried
    messages = len({(e.worker, e.request_id) for e in events if type(e).__name__ == "RequestsDispatched"})
    samples = sum(e.samples for e in events if type(e).__name__ == "OptimizerStep")
    cli = time.perf_counter()
    command = subprocess.run([sys.executable, "-m", "flexmarl.controller.cli", "replay", "--check", path],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cli_s = time.perf_counter() - cli
    return {"replay_cli_s": round(cli_s, 2), "replay_cli_vs_run": round(wall_s / cli_s, 2),
            "replay_cli_vs_whole_run": round(run_s / cli_s, 2),
            "replay_cli_ok": command.returncode == 0 or command.stderr[-300:],
            "generate_messages": messages, "generate_per_sample": round(messages / samples, 3) if samples else None,
            "replay_events": len(events), "replay_read_s": round(t1 - t0, 2), "replay_summary_s": round(t2 - t1, 2),
            "replay_check_s": round(t3 - t2, 2), "replay_total_s": round(t3 - t0, 2),
            "replay_vs_run": round(wall_s / (t3 - t0), 2), "replay_ok": not problem and not summary.errors and diff is None,
            "replay_problem": problem or (summary.errors[:2] if summary.errors else diff)}


def one_point(point: dict[str, Any], keep: str = "", replay: bool = False, profile: str = "") -> dict[str, Any]:
    p = complete(point)
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="flx-scale-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    cores = os.sched_getaffinity(0)
    try:
        row = run_async(lambda: run_point(p, root, profile))
        if replay:
            os.sched_setaffinity(0, cores)  # a pinned run's controller had one; the replay may use them all
            row.update(time_replay(row["events_log"], row["wall_s"], row["run_s"]))
        return row
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


COLUMNS = [("instances", "inst"), ("agents", "agents"), ("trainers", "trn"), ("shape", "shape"), ("mode", "mode"),
           ("k", "K"), ("samples", "samples"), ("samples_s", "samples/s"), ("cpu_us_sample", "cpu us/smp"),
           ("cpu_frac", "cpu"), ("loop_cpu_frac", "loop cpu"), ("loop_runq_frac", "loop runq"),
           ("cluster_cpu_frac", "fakes cpu"), ("cluster_runq_frac", "fakes runq"),
           ("generate_per_sample", "GENERATE/smp"), ("lag_p50_ms", "lag p50 ms"),
           ("lag_p99_ms", "lag p99 ms"),
           ("log_mb_s", "log MB/s"), ("rss_mb", "RSS MB"), ("rollout_busy", "eng busy"),
           ("capacity_s", "eng cap/s"), ("waited", "waited"), ("accounting", "acct")]


def table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(h for _, h in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(str(r.get(k, "")) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def sweep(points: list[dict[str, Any]], replay_last: bool) -> list[dict[str, Any]]:
    rows = []
    for i, point in enumerate(points):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--point", json.dumps(point)]
        if replay_last and i == len(points) - 1:
            cmd.append("--replay")
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            row = {**complete(point), "error": (out.stderr or out.stdout)[-1500:]}
        else:
            row = json.loads(lines[-1])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def by_module(path: str, top: int = 16) -> list[tuple[str, float]]:
    """A profile's own time (cProfile's tottime) summed by where the code lives: our modules
    by name (`controller.state.store`), a library by its package (`zmq`, `asyncio`, `msgspec`),
    built-in functions as `built-ins`; each as a share of the whole, largest first."""
    import pstats

    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    spent: dict[str, float] = {}
    for (filename, _, _), (_, _, tottime, _, _) in stats.items():
        spent[module_of(filename)] = spent.get(module_of(filename), 0.0) + tottime
    total = sum(spent.values()) or 1.0
    return [(name, t / total) for name, t in sorted(spent.items(), key=lambda kv: -kv[1])[:top]]


# The project's packages in this checkout: their files are named by module, whatever the path.
PACKAGES = [Path(__file__).resolve().parents[2] / name for name in ("controller", "runtime", "workers")]


def module_of(filename: str) -> str:
    if filename == "~" or filename.startswith("<"):
        return "built-ins"
    path = Path(filename)
    parts = path.with_suffix("").parts
    if "flexmarl" in parts:
        return ".".join(parts[parts.index("flexmarl") + 1:])
    for package in PACKAGES:  # the project's own packages where they sit in a checkout (an editable install)
        if path.is_relative_to(package):
            return ".".join(path.with_suffix("").relative_to(package.parent).parts)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return parts[parts.index(anchor) + 1]
    if "bench" in parts:
        return "bench." + path.stem
    return path.stem if parts[-2].startswith("python3") else parts[-2]  # the standard library: selectors, asyncio, ...


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", help="run one point (JSON: instances, agents, trainers, shape, mode, k, ...)")
    parser.add_argument("--smoke", action="store_true", help="one tiny point, printed as a row and a table")
    parser.add_argument("--replay", action="store_true", help="time `replay --check` on the point's log")
    parser.add_argument("--profile", default="", help="cProfile the controller while it trains (the measured "
                        "window alone, the loop thread's CPU time), to this file")
    parser.add_argument("--by-module", default="", metavar="FILE.prof",
                        help="print where a --profile file's time went, by module, and stop")
    parser.add_argument("--keep", default="", help="keep the point's run directory here")
    parser.add_argument("--only", default="", help="sweep points to run, by index (e.g. 0,5,7)")
    parser.add_argument("--pin", action="store_true", help="every point with a core of its own for the controller")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.by_module:
        for name, share in by_module(args.by_module):
            print(f"{100 * share:5.1f}%  {name}")
        return
    if args.point or args.smoke:
        point = json.loads(args.point) if args.point else {"instances": 8, "agents": 4, "trainers": 2, "steps": 2,
                                                            "mode": "async", "k": 1}
        row = one_point(point, args.keep, args.replay, args.profile)
        print(json.dumps(row), flush=True)
        if args.smoke:
            print(table([row]))
        return
    points = [dict(zip(("instances", "agents", "trainers", "shape", "mode", "k"), s)) for s in SWEEP]
    if args.only:
        points = [points[int(i)] for i in args.only.split(",")]
    if args.pin:
        points = [{**p, "pin": True} for p in points]
    t0 = time.monotonic()
    rows = sweep(points, replay_last=args.replay)
    print(table(rows))
    print(f"sweep: {len(rows)} points in {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
