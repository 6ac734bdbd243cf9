"""Starts worker processes on this host, restarts the ones that die, stops exactly those, by PID.

`Launcher` is what `flexmarl run` starts its workers with, chosen by `cluster.launcher`
from LAUNCHERS (launchers.py): `LocalLauncher` here, `RayLauncher` (ray_launcher.py) on a
Ray cluster. A launcher says where the controller binds (`endpoint`) and hands back
`Workers`: how a worker is started, noticed gone, started again, stopped when hung
(`signal`), cleaned up after (`reclaim`) and stopped. The restart policy is written once,
here, over that interface, for every launcher.

Used by `flexmarl run`, `Experiment` and the integration tests. Each local worker is a child
process in its own process group (so a Ctrl-C in the terminal reaches the controller,
which then shuts workers down in order) that watches this process and exits when it is
gone, however it died (runtime/parent_watch.py); `stop()` escalates SIGTERM -> SIGKILL under a
time limit and never touches a process it did not start.

`WorkerRestarter` starts a worker that exited while the run goes on again, with the same
id, role and (appended) log, after a backoff; `RestartPolicy` decides how long to wait,
when to give up (`cluster.max_restarts` per worker) and how a worker the controller
declared dead while its process is still there (hung, stopped, not reading) is stopped:
SIGTERM, then SIGKILL after a grace period; it is then started again like one that
exited. It does not know what the worker was doing: the controller hands a worker that
registers again its work back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine, Generic, Protocol, TypeVar

from flexmarl.runtime.config import ExperimentConfig, TransportConfig
from flexmarl.runtime.params.shm_segments import OWNER_ENV, remove_orphan_engine_dirs, remove_orphan_segments

log = logging.getLogger("flexmarl.launcher")

LOG_TAIL_CHARS = 2000  # of a worker's log, in the error that stops a run
MAX_BACKOFF_S = 30.0
WATCH_INTERVAL_S = 0.25  # how often the restarter looks for exited processes
KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL, for a worker declared dead whose process is still there


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

    def alive(self) -> bool: ...  # its process (or actor) is still there, as last seen

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

    def signal(self, worker: W, sig: int) -> None: ...  # to a hung worker: SIGTERM, then SIGKILL

    def reclaim(self, worker: W) -> None: ...  # what an exited worker left that no one else may use

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

    def alive(self) -> bool:
        return self.proc.poll() is None

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
        env = dict(os.environ, **worker_env(self.threads),
                   **{OWNER_ENV: str(os.getpid())},  # names its shared memory as this run's (shm_segments)
                   **self.extra_env, **pinning_env(gpus))
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

    def signal(self, wp: WorkerProcess, sig: int) -> None:
        """Sends `sig` to the worker's process (if it is still there)."""
        _signal(wp, sig)

    def reclaim(self, wp: WorkerProcess) -> None:
        """Removes what the exited process left that no one else may use (a rollout
        engine's directories); its parameter segments wait for `stop` (a parked copy in
        one may still be loaded)."""
        removed = remove_orphan_engine_dirs(pids=[wp.proc.pid])
        if removed:
            log.info("removed %d directories left by %s (pid %d)", len(removed), wp.worker_id, wp.proc.pid)

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
            removed = remove_orphan_segments(pids=gone) + remove_orphan_engine_dirs(pids=gone)
            if removed:
                log.info("removed %d shared-memory files left by dead workers", len(removed))

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
    # A worker declared dead whose process is still there gets SIGTERM, and SIGKILL this
    # much later if it is still there (a stopped process never handles SIGTERM).
    kill_grace_s: float = KILL_GRACE_S
    restarts: dict[str, int] = field(default_factory=dict)  # worker id -> restarts so far

    def next_delay(self, worker_id: str) -> float | None:
        """Seconds to wait before restarting `worker_id` (and counts the restart), or
        None when it has been restarted `max_restarts` times already."""
        done = self.restarts.get(worker_id, 0)
        if done >= self.max_restarts:
            return None
        self.restarts[worker_id] = done + 1
        return min(self.backoff_s * 2 ** done, self.max_backoff_s)

    def stop_signal(self, declared_dead_s: float, signalled: int | None) -> int | None:
        """The signal for a worker declared dead `declared_dead_s` ago whose process is
        still there, `signalled` the last one it got (None: none yet); None: wait."""
        if signalled is None:
            return signal.SIGTERM
        if signalled == signal.SIGTERM and declared_dead_s >= self.kill_grace_s:
            return signal.SIGKILL
        return None


class WorkerRestarter(Generic[W]):
    """Watches the workers a launcher started and restarts the ones that exit while the run
    goes on (see `RestartPolicy`).

    `check()` is one look: every process that exited since is reported through `on_exit`
    at once (so the controller declares it dead before anything else reacts) and started
    again once its backoff has passed, reported through `on_restart(old, new, restarts)`. A
    worker past its limit raises `WorkerFailed` naming it, its exit code and its log's
    end. A worker the controller declared dead (`declared_dead`) whose process is still
    there is stopped as the policy says (`RestartPolicy.stop_signal`), and then restarted
    like any that exited. Nothing is restarted once `stopping()` says the run is shutting
    down. `run()` looks every `WATCH_INTERVAL_S` and never returns; its failure stops the
    run. `restarting(role)` says whether a worker of that role is on its way back."""

    def __init__(self, workers: Workers[W], policy: RestartPolicy, *, stopping: Callable[[], bool],
                 on_exit: Callable[[LaunchedWorker, str], None] = lambda wp, why: None,
                 on_restart: Callable[[LaunchedWorker, LaunchedWorker, int], None] = lambda old, new, n: None,
                 registered: Callable[[str], bool] = lambda worker_id: True, start_timeout_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.workers = workers
        self.policy = policy
        self.stopping = stopping
        self.on_exit = on_exit
        self.on_restart = on_restart
        self.registered = registered  # whether the worker's current process registered
        self.start_timeout_s = start_timeout_s  # a restarted process that has not registered by then is not coming
        self.clock = clock
        self.due: dict[str, float] = {}  # worker id -> when its restart is due
        self.started: dict[str, float] = {}  # worker id -> when its process was last started again
        # worker id -> (when it was declared dead, the last signal sent to its process)
        self.hung: dict[str, tuple[float, int | None]] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            self.check()

    def declared_dead(self, worker_id: str, why: str) -> None:
        """The controller gave up on the worker; if its process is still there, `check`
        stops it (and then restarts it)."""
        wp = next((wp for wp in self.workers.procs if wp.worker_id == worker_id), None)
        if self.stopping() or wp is None or not wp.alive() or worker_id in self.hung:
            return
        log.warning("worker %s was declared dead (%s) but its process (pid %d) is still there: stopping it "
                    "(SIGTERM, then SIGKILL after %gs) to start it again", worker_id, why, wp.pid,
                    self.policy.kill_grace_s)
        self.hung[worker_id] = (self.clock(), None)

    def restarting(self, role: str) -> bool:
        """Whether a worker of `role` is being stopped, waits for its restart, or was
        started again (less than `start_timeout_s` ago) and has not registered yet."""
        def on_its_way(worker_id: str) -> bool:
            starting = self.clock() - self.started.get(worker_id, -math.inf) < self.start_timeout_s
            return worker_id in self.due or worker_id in self.hung or (starting and not self.registered(worker_id))

        return any(wp.role == role and on_its_way(wp.worker_id) for wp in self.workers.procs)

    def check(self) -> None:
        if self.stopping():
            return
        now = self.clock()
        self._stop_hung(now)
        for wp in self.workers.exited():
            if wp.worker_id not in self.due:
                self._noticed(wp, now)
            if self.due[wp.worker_id] <= now:
                del self.due[wp.worker_id]
                new = self.workers.restart(wp)
                self.started[wp.worker_id] = now
                self.on_restart(wp, new, self.policy.restarts[wp.worker_id])

    def _stop_hung(self, now: float) -> None:
        for wp in self.workers.procs:
            if wp.worker_id not in self.hung or not wp.alive():
                continue
            since, signalled = self.hung[wp.worker_id]
            sig = self.policy.stop_signal(now - since, signalled)
            if sig is not None:
                self.workers.signal(wp, sig)
                self.hung[wp.worker_id] = (since, sig)

    def _noticed(self, wp: W, now: float) -> None:
        self.hung.pop(wp.worker_id, None)
        self.workers.reclaim(wp)
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
