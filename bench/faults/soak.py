"""Soak: the default job for a long while, async K = 1, with a process killed every few
minutes; prints lost and doubled samples, the recovery time after each kill and every
process's memory growth.

The run is a real `flexmarl run` (controller and workers as processes, as a user starts
it). Every --kill-every seconds one process gets SIGKILL, in turn: a rollout worker, a
trainer, the controller. The launcher restarts a dead worker and the run mends itself; a
dead controller is followed by `flexmarl run --resume` on the same run directory (its
orphaned workers are stopped by PID first, as an operator would). Recovery time is from
the kill until the run trains again: the first optimizer step logged after it (for a
rollout worker, also until the restarted worker answers requests again). Every
--sample-s seconds each process's resident memory (VmRSS) is read from /proc.

At the end the controller gets SIGINT (a normal stop), and the event log is summarised by
the same code as `flexmarl replay`: every sample generated must be trained, dropped or in
flight at the stop, none twice, across every restart and resume.

    .venv/bin/python bench/faults/soak.py [--minutes 30] [--kill-every 180] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import LogTail, read_events

KINDS = ("rollout", "trainer", "controller")


@dataclass
class Kill:
    kind: str
    victim: str
    pid: int
    at: float  # wall-clock seconds since the soak started
    resumed: bool = False  # controller: the new controller logged its RunResumed
    rejoined: bool = False  # rollout: the restarted worker registered
    recovered_s: float | None = None
    serving_again_s: float | None = None  # rollout: the restarted worker answers requests


@dataclass
class Memory:
    samples: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)  # (name, pid) -> (t, MiB)

    def sample(self, name: str, pid: int, t: float) -> None:
        try:
            with open(f"/proc/{pid}/status") as fh:
                rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            return
        self.samples.setdefault((name, pid), []).append((t, rss))


def controller_cmd(args: argparse.Namespace, resume: bool) -> list[str]:
    base = [sys.executable, "-m", "flexmarl.controller.cli", "run", "--no-progress"]
    if resume:
        return base + ["--resume", str(args.out)]
    return base + ["--out", str(args.out), "--mode", "async", "--max-staleness", "1", "--steps", "100000",
                   "--seed", str(args.seed), "--set", f"run.checkpoint_every={args.checkpoint_every}",
                   "--set", f"cluster.max_restarts={args.max_restarts}"]


def start_controller(args, resume: bool, log_fh) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen(controller_cmd(args, resume), env=env, stdout=log_fh, stderr=subprocess.STDOUT)


class Watch:
    """What the soak follows in the live event log (read incrementally)."""

    def __init__(self, run_dir: Path) -> None:
        self.tail = LogTail(run_dir / "events.log")
        self.workers: dict[str, tuple[str, int]] = {}  # worker id -> (role, pid) of its live incarnation
        self.stepped = False

    def poll(self) -> list[ev.Event]:
        new = self.tail.poll()
        for e in new:
            if isinstance(e, ev.WorkerJoined):
                self.workers[e.worker] = (e.role, e.pid)
            elif isinstance(e, ev.WorkerDied):
                self.workers.pop(e.worker, None)
            elif isinstance(e, ev.OptimizerStep):
                self.stepped = True
        return new

    def live(self) -> dict[str, tuple[str, int]]:
        """Registered workers whose process runs (a killed controller's workers were
        stopped; the new controller's registered under the same ids)."""
        return {w: rp for w, rp in self.workers.items() if _alive(rp[1])}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def watch_recovery(kill: Kill, new: list[ev.Event], now: float) -> None:
    """Updates `kill` with the events logged since the last look (all after the kill)."""
    for e in new:
        if isinstance(e, ev.RunResumed):
            kill.resumed = True
        elif isinstance(e, ev.OptimizerStep) and kill.recovered_s is None:
            if kill.kind != "controller" or kill.resumed:
                kill.recovered_s = now - kill.at
        elif isinstance(e, ev.WorkerJoined) and e.worker == kill.victim:
            kill.rejoined = True
        elif (isinstance(e, ev.RequestsCompleted) and e.worker == kill.victim and kill.rejoined
              and kill.kind == "rollout" and kill.serving_again_s is None):
            kill.serving_again_s = now - kill.at


def slope_mib_per_min(series: list[tuple[float, float]]) -> float | None:
    """Least-squares slope over the second half of a process's life (the first half holds
    start-up: engines, models, caches)."""
    half = series[len(series) // 2:]
    if len(half) < 3 or half[-1][0] - half[0][0] < 60:
        return None
    ts, ms = [t for t, _ in half], [m for _, m in half]
    mt, mm = statistics.fmean(ts), statistics.fmean(ms)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (m - mm) for t, m in zip(ts, ms)) / var * 60 if var else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kill-every", type=float, default=180.0, metavar="S")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--max-restarts", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/soak"))
    args = ap.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"{args.out} is not empty; choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    log_fh = open(args.out.parent / f"{args.out.name}-controller.log", "ab")
    t0 = time.monotonic()
    controller = start_controller(args, False, log_fh)
    watch = Watch(args.out)
    kills: list[Kill] = []
    memory = Memory()
    next_kill, next_sample, turn = args.kill_every, 0.0, 0
    end = args.minutes * 60
    while (now := time.monotonic() - t0) < end:
        new = watch.poll()
        for kill in kills:
            watch_recovery(kill, new, now)
        if controller.poll() is not None:
            print(f"the controller exited on its own with code {controller.returncode}", file=sys.stderr)
            return 1
        workers = watch.live()
        if now >= next_sample:
            memory.sample("controller", controller.pid, now)
            for worker, (_, pid) in workers.items():
                memory.sample(worker, pid, now)
            next_sample = now + args.sample_s
        if now >= next_kill and watch.stepped and all(k.recovered_s is not None for k in kills):
            kind = KINDS[turn % len(KINDS)]
            if kind == "controller":
                kill = Kill(kind, "controller", controller.pid, now)
                _kill(controller.pid)
                controller.wait()
                watch.poll()
                for _, pid in watch.live().values():
                    _kill(pid)  # its orphans: an operator stops them before resuming
                controller = start_controller(args, True, log_fh)
            else:
                candidates = sorted(w for w, (role, _) in workers.items() if role == kind)
                if not candidates:  # none registered right now (one is restarting): next time
                    time.sleep(1.0)
                    continue
                victim = candidates[0]
                kill = Kill(kind, victim, workers[victim][1], now)
                _kill(kill.pid)
            kills.append(kill)
            turn += 1
            print(f"{now:7.1f}s  killed {kind} {kill.victim} (pid {kill.pid})", flush=True)
            next_kill = now + args.kill_every
        time.sleep(1.0)

    controller.send_signal(signal.SIGINT)  # a normal stop: workers are shut down in order
    try:
        controller.wait(timeout=120)
    except subprocess.TimeoutExpired:
        controller.kill()
        controller.wait()
    new = watch.poll()
    for kill in kills:
        watch_recovery(kill, new, time.monotonic() - t0)
    events, problem = read_events(args.out / "events.log")
    if problem:
        print(f"warning: {problem}", file=sys.stderr)
    summary = replay.summarize(events)
    report(args, kills, memory, summary, events)
    return 1 if summary.errors else 0


def report(args, kills, memory, summary, events) -> None:
    steps = [e for e in replay.lineage(events) if isinstance(e, ev.OptimizerStep)]
    print(f"\nsoak: {args.minutes:.0f} min, default job, async K=1, a kill every {args.kill_every:.0f} s; "
          f"{len({e.version for e in steps})} steps reached, {len(kills)} kills")
    totals = [r for r in summary.accounting if r.total]
    print("\nsamples (generated = trained + dropped + in flight at the stop), over the final lineage:")
    print(f"  {'agent':<9}{'generated':>10}{'trained':>9}{'dropped':>9}{'in flight':>10}")
    for r in totals:
        print(f"  {r.agent:<9}{r.generated:>10}{r.trained:>9}{r.dropped:>9}{r.in_flight:>10}")
    lost_or_doubled = [e for e in summary.errors]
    print(f"  lost or trained twice: {'none' if not lost_or_doubled else lost_or_doubled}")
    restored = [e for e in events if isinstance(e, ev.TrainingRestored)]
    print(f"  training states restored after a trainer death: {len(restored)}; "
          f"resumes: {sum(isinstance(e, ev.RunResumed) for e in events)}; "
          f"worker restarts: {sum(isinstance(e, ev.WorkerRestarted) for e in events)}")
    print("\nrecovery after each kill (s from SIGKILL to the next optimizer step; rollout: also to answering again):")
    for k in kills:
        serving = f", serving again {k.serving_again_s:.1f}" if k.serving_again_s is not None else ""
        recovered = f"{k.recovered_s:.1f}" if k.recovered_s is not None else "not before the stop"
        print(f"  {k.at:7.1f}s  {k.kind:<10} {k.victim:<11} recovered {recovered}{serving}")
    print("\nmemory (VmRSS, MiB) per process: first, last, slope over the second half of its life")
    for (name, pid), series in sorted(memory.samples.items()):
        slope = slope_mib_per_min(series)
        span = (series[-1][0] - series[0][0]) / 60
        print(f"  {name:<12} pid {pid:<8} {series[0][1]:8.1f} {series[-1][1]:8.1f}  "
              f"{'%+.2f MiB/min' % slope if slope is not None else '(too short)':>14}  over {span:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
