"""Starts worker processes on this host, restarts the ones that die, stops exactly those, by PID.

`Launcher` is what `flexmarl run` starts its workers with, chosen by `cluster.launcher`
from LAUNCHERS: `LocalLauncher` here, `RayLauncher` (ray_launcher.py) on a Ray cluster.
A launcher says where the controller binds (`endpoint`) and hands back `Workers`: how a
worker is started, noticed gone, started again and stopped. The restart policy is written
once, here, over that interface, for every launcher.

Used by `flexmarl run`, `Experiment` and the integration tests. Each local worker is a child
process in its own process group (so a Ctrl-C in the terminal reaches the controller,
which then shuts workers down in order) that watches this process and exits when it is
gone, however it died (runtime/parent_watch.py); `stop()` escalates SIGTERM -> SIGKILL under a
time limit and never touches a process it did not start.

`WorkerRestarter` starts a worker that exited while the run goes on again, with the same
id, role and (appended) log, after a backoff; `RestartPolicy` decides how long to wait and
when to give up (`cluster.max_restarts` per worker). It does not know what the worker was
doing: the controller hands a worker that registers again its work back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine, Protocol, TypeVar

from flexmarl.runtime.config import ExperimentConfig, TransportConfig
from flexmarl.runtime.shm_segments import remove_orphan_segments

log = logging.getLogger("flexmarl.launcher")

LOG_TAIL_CHARS = 2000  # of a worker's log, in the error that stops a run
MAX_BACKOFF_S = 30.0
WATCH_INTERVAL_S = 0.25  # how often the restarter looks for exited processes


class WorkerFailed(RuntimeError):
    """A worker exited and is not started again (it failed too often)."""


class LaunchError(RuntimeError):
    """The workers cannot be started where the config says (no Ray, no cluster, no room for
    them): raised before any worker starts, with one line saying what to do."""


class LaunchedWorker(Protocol):
    """One worker a launcher started (its current process, or Ray actor)."""

    worker_id: str
    role: str
    log_path: Path | None

    @property
    def pid(self) -> int: ...  # its process; 0 while not known (a Ray actor being placed)

    @property
    def exit_code(self) -> int | None: ...  # None while it runs, or where it ended without one

    def ended(self) -> str: ...  # how it ended, as a predicate: "exited with code -9"

    def why_exited(self) -> str: ...  # the same as a sentence about its process, for the controller


W = TypeVar("W", bound=LaunchedWorker)  # a launcher's kind of worker: WorkerProcess, RayWorker


class Workers(Protocol[W]):
    """The workers a launcher started: all the restarter and the experiment use."""

    procs: list[W]  # the current one of every worker id

    def start(self, role: str, worker_id: str, gpus: list[int] | None = None) -> W: ...

    def restart(self, old: W) -> W: ...  # the new one takes `old`'s place in procs

    def exited(self) -> list[W]: ...

    def log_tail(self, worker: W) -> str: ...

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]: ...  # named tasks to run while the run goes on

    def stop(self, timeout: float = 10.0, grace: float = 0.0) -> None: ...


class Launcher(Protocol):
    """Made before anything starts (a missing cluster fails here); closed last."""

    def endpoint(self, transport: TransportConfig) -> tuple[str, str]: ...  # the address to bind, its CURVE dir

    def workers(self, address: str, log_dir: Path) -> Workers[Any]: ...

    def close(self) -> None: ...


def worker_argv(role: str, worker_id: str, address: str, threads: int, group_size: int) -> list[str]:
    """The arguments, after the Python executable, of a worker a launcher starts. It never
    reconnects to a controller that went away: a new controller starts workers of its own."""
    argv = ["-m", "flexmarl.workers.main", "--role", role, "--connect", address, "--worker-id", worker_id,
            "--threads", str(threads), "--reconnect-timeout", "0"]
    if role == "trainer" and group_size > 1:
        argv += ["--group-size", str(group_size)]  # it starts its other ranks itself
    return argv


def worker_env(threads: int) -> dict[str, str]:
    """What every started worker's environment says, whoever starts it."""
    return {"OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class WorkerProcess:
    worker_id: str
    role: str
    proc: subprocess.Popen
    log_path: Path | None
    gpus: list[int] | None = None  # what it is pinned to; a restart pins it the same

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exit_code(self) -> int | None:
        return self.proc.returncode

    def ended(self) -> str:
        return f"exited with code {self.proc.returncode}"

    def why_exited(self) -> str:
        return f"its process (pid {self.proc.pid}) {self.ended()}"


class LocalLauncher:
    """Workers as child processes of the controller, on this host, at the address configured."""

    def __init__(self, config: ExperimentConfig) -> None:
        self.cluster = config.cluster
        self.curve_dir = config.transport.curve_dir

    def endpoint(self, transport: TransportConfig) -> tuple[str, str]:
        return transport.address, transport.curve_dir

    def workers(self, address: str, log_dir: Path) -> "LocalWorkers":
        return LocalWorkers(address, log_dir, curve_dir=self.curve_dir, threads=self.cluster.threads_per_worker,
                            trainer_group_size=self.cluster.trainer_group_size)

    def close(self) -> None:
        pass


class LocalWorkers:
    def __init__(self, address: str, log_dir: Path | None = None, *,
                 curve_dir: str = "", threads: int = 1, extra_env: dict[str, str] | None = None,
                 trainer_group_size: int = 1) -> None:
        self.address = address
        self.trainer_group_size = trainer_group_size
        self.log_dir = log_dir
        self.curve_dir = curve_dir
        self.threads = threads
        self.extra_env = extra_env or {}
        self.procs: list[WorkerProcess] = []  # the current process of every worker id
        self.retired: list[WorkerProcess] = []  # earlier processes of restarted workers

    def start(self, role: str, worker_id: str, gpus: list[int] | None = None) -> WorkerProcess:
        """Start one worker; with `gpus`, pinned to exactly those (CUDA_VISIBLE_DEVICES), so
        inside it they are cuda:0, cuda:1, ... in that order."""
        cmd = [sys.executable, *worker_argv(role, worker_id, self.address, self.threads, self.trainer_group_size),
               "--parent-pid", str(os.getpid())]  # it exits when this process dies, however it dies
        if self.curve_dir:
            cmd += ["--curve-dir", self.curve_dir]
        env = dict(os.environ, **worker_env(self.threads), **self.extra_env, **pinning_env(gpus))
        log_path = None
        stdout = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{worker_id}.log"
            stdout = open(log_path, "ab")
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        if stdout is not None:
            stdout.close()
        wp = WorkerProcess(worker_id, role, proc, log_path, gpus)
        self.procs.append(wp)
        log.info("started %s worker %s (pid %d)", role, worker_id, proc.pid)
        return wp

    def restart(self, old: WorkerProcess) -> WorkerProcess:
        """Starts `old`'s worker again (same id, role and log); the new process takes
        `old`'s place in `procs`."""
        note_restart(old.log_path, f"pid {old.proc.pid} exited with code {old.proc.returncode}")
        new = self.start(old.role, old.worker_id, old.gpus)
        self.procs.remove(new)
        self.procs[self.procs.index(old)] = new
        self.retired.append(old)
        return new

    def exited(self) -> list[WorkerProcess]:
        return [wp for wp in self.procs if wp.proc.poll() is not None]

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {}  # their output goes straight to their log files

    def log_tail(self, wp: WorkerProcess) -> str:
        return log_tail(wp.log_path)

    def pids(self) -> list[int]:
        """Every process started, restarted ones included."""
        return [wp.proc.pid for wp in self.procs + self.retired]

    def running(self) -> list[WorkerProcess]:
        return [wp for wp in self.procs if wp.proc.poll() is None]

    def wait(self, timeout: float) -> bool:
        """True if every started process has exited within `timeout`."""
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout: float = 10.0, grace: float = 0.0) -> None:
        """Waits `grace` seconds for workers already told to shut down, then SIGTERMs
        the survivors and SIGKILLs whatever is left after `timeout`; then removes the
        shared-memory segments of workers that died without removing them."""
        try:
            self._stop(timeout, grace)
        finally:
            gone = [wp.proc.pid for wp in self.procs + self.retired if wp.proc.returncode is not None]
            removed = remove_orphan_segments(pids=gone)
            if removed:
                log.info("removed %d shared-memory segments left by dead workers", len(removed))

    def _stop(self, timeout: float, grace: float) -> None:
        if grace > 0 and self.wait(grace):
            return
        for wp in self.running():
            _signal(wp, signal.SIGTERM)
        if not self.wait(timeout):
            for wp in self.running():
                log.warning("worker %s (pid %d) ignored SIGTERM; killing it", wp.worker_id, wp.proc.pid)
                _signal(wp, signal.SIGKILL)
            self.wait(5.0)
        for wp in self.procs:
            if wp.proc.returncode is None:
                wp.proc.wait(timeout=1.0)


def log_tail(log_path: Path | None, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of a worker's log, for the error that stops a run."""
    if log_path is None or not log_path.exists():
        return "(no log file: its output went to the controller's terminal)"
    with open(log_path, "rb") as fh:
        fh.seek(max(0, log_path.stat().st_size - chars))
        return fh.read().decode(errors="replace")


def note_restart(log_path: Path | None, what_ended: str) -> None:
    """Marks in a worker's log where its next life starts (the log is appended to)."""
    if log_path is not None and log_path.exists():
        with open(log_path, "a") as fh:
            fh.write(f"\n--- {what_ended}; restarting ---\n")


def pinning_env(gpus: list[int] | None) -> dict[str, str]:
    """The environment that pins a process to `gpus`; None: no pinning (inherited as is)."""
    if gpus is None:
        return {}
    # Bus order, so numbers mean what nvidia-smi shows, not CUDA's fastest-first order.
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _signal(wp: WorkerProcess, sig: int) -> None:
    try:
        wp.proc.send_signal(sig)
    except ProcessLookupError:
        pass


@dataclass
class RestartPolicy:
    """How often, and after how long, a worker that exited is started again. Plain
    decisions over counts: the first restart of a worker waits `backoff_s`, each further
    one twice as long (at most `max_backoff_s`); past `max_restarts` it is not restarted."""

    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = MAX_BACKOFF_S
    restarts: dict[str, int] = field(default_factory=dict)  # worker id -> restarts so far

    def next_delay(self, worker_id: str) -> float | None:
        """Seconds to wait before restarting `worker_id` (and counts the restart), or
        None when it has been restarted `max_restarts` times already."""
        done = self.restarts.get(worker_id, 0)
        if done >= self.max_restarts:
            return None
        self.restarts[worker_id] = done + 1
        return min(self.backoff_s * 2 ** done, self.max_backoff_s)


class WorkerRestarter:
    """Watches the workers a launcher started and restarts the ones that exit while the run
    goes on (see `RestartPolicy`).

    `check()` is one look: every process that exited since is reported through `on_exit`
    at once (so the controller declares it dead before anything else reacts) and started
    again once its backoff has passed, reported through `on_restart(old, new, restarts)`. A
    worker past its limit raises `WorkerFailed` naming it, its exit code and its log's
    end. Nothing is restarted once `stopping()` says the run is shutting down. `run()`
    looks every `WATCH_INTERVAL_S` and never returns; its failure stops the run."""

    def __init__(self, workers: Workers[Any], policy: RestartPolicy, *, stopping: Callable[[], bool],
                 on_exit: Callable[[LaunchedWorker, str], None] = lambda wp, why: None,
                 on_restart: Callable[[LaunchedWorker, LaunchedWorker, int], None] = lambda old, new, n: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.workers = workers
        self.policy = policy
        self.stopping = stopping
        self.on_exit = on_exit
        self.on_restart = on_restart
        self.clock = clock
        self.due: dict[str, float] = {}  # worker id -> when its restart is due

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            self.check()

    def check(self) -> None:
        if self.stopping():
            return
        now = self.clock()
        for wp in self.workers.exited():
            if wp.worker_id not in self.due:
                self._noticed(wp, now)
            if self.due[wp.worker_id] <= now:
                del self.due[wp.worker_id]
                new = self.workers.restart(wp)
                self.on_restart(wp, new, self.policy.restarts[wp.worker_id])

    def _noticed(self, wp: LaunchedWorker, now: float) -> None:
        why = wp.why_exited()
        self.on_exit(wp, why)
        delay = self.policy.next_delay(wp.worker_id)
        if delay is None:
            message = (f"worker {wp.worker_id} ({wp.role}) {wp.ended()} after "
                       f"{self.policy.max_restarts} restarts; not starting it again. Its log "
                       f"({wp.log_path}) ends with:\n{self.workers.log_tail(wp)}")
            log.error("%s", message)
            raise WorkerFailed(message)
        log.warning("worker %s %s; starting it again in %.1fs (restart %d of %d)", wp.worker_id, why, delay,
                    self.policy.restarts[wp.worker_id], self.policy.max_restarts)
        self.due[wp.worker_id] = now + delay


def _ray_launcher(config: ExperimentConfig) -> Launcher:
    from .ray_launcher import RayLauncher  # Ray is imported only where it is asked for

    return RayLauncher(config)


# cluster.launcher -> what makes the launcher (Ray's connects to its cluster, before anything starts)
LAUNCHERS: dict[str, Callable[[ExperimentConfig], Launcher]] = {"local": LocalLauncher, "ray": _ray_launcher}
