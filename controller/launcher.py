"""Starts worker processes on this host and stops exactly those, by PID.

Used by `flexmarl run`, `Experiment` and the integration tests. Each worker is a child
process in its own process group (so a Ctrl-C in the terminal reaches the controller,
which then shuts workers down in order); `stop()` escalates SIGTERM -> SIGKILL under a
time limit and never touches a process it did not start.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flexmarl.runtime.shm_segments import remove_orphan_segments

log = logging.getLogger("flexmarl.launcher")


@dataclass
class WorkerProcess:
    worker_id: str
    role: str
    proc: subprocess.Popen
    log_path: Path | None


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
        self.procs: list[WorkerProcess] = []

    def start(self, role: str, worker_id: str, gpus: list[int] | None = None) -> WorkerProcess:
        """Start one worker; with `gpus`, pinned to exactly those (CUDA_VISIBLE_DEVICES), so
        inside it they are cuda:0, cuda:1, ... in that order."""
        cmd = [sys.executable, "-m", "flexmarl.workers.main", "--role", role,
               "--connect", self.address, "--worker-id", worker_id,
               "--threads", str(self.threads)]
        if self.curve_dir:
            cmd += ["--curve-dir", self.curve_dir]
        if role == "trainer" and self.trainer_group_size > 1:
            cmd += ["--group-size", str(self.trainer_group_size)]  # it starts its other ranks itself
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), VLLM_ENABLE_V1_MULTIPROCESSING="0",
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
        wp = WorkerProcess(worker_id, role, proc, log_path)
        self.procs.append(wp)
        log.info("started %s worker %s (pid %d)", role, worker_id, proc.pid)
        return wp

    def pids(self) -> list[int]:
        return [wp.proc.pid for wp in self.procs]

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
            gone = [wp.proc.pid for wp in self.procs if wp.proc.returncode is not None]
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
