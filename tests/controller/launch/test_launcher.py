"""The local launcher: the restart policy and the restarter over fake processes and a fake
clock; GPU pinning and trainer groups with a stand-in for the process it would start."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from flexmarl.controller.launch import launcher
from flexmarl.controller.launch.launcher import (
    LocalWorkers,
    RestartPolicy,
    WorkerFailed,
    WorkerProcess,
    WorkerRestarter,
)


class FakeProc:
    def __init__(self, pid, returncode=None):
        self.pid = pid
        self.returncode = returncode

    def poll(self):
        return self.returncode


class FakeWorkers:
    """What the restarter is handed: exited(), restart(), log_tail()."""

    def __init__(self, *ids):
        self.procs = [WorkerProcess(w, "rollout", FakeProc(100 + i), Path(f"/logs/{w}.log")) for i, w in enumerate(ids)]
        self.started = []
        self.signals = []
        self.reclaimed = []

    def die(self, worker_id, code):
        next(wp for wp in self.procs if wp.worker_id == worker_id).proc.returncode = code

    def exited(self):
        return [wp for wp in self.procs if wp.proc.poll() is not None]

    def restart(self, old):
        new = WorkerProcess(old.worker_id, old.role, FakeProc(old.proc.pid + 1000), old.log_path)
        self.procs[self.procs.index(old)] = new
        self.started.append(new)
        return new

    def log_tail(self, wp):
        return "Traceback ...\nRuntimeError: engine failed to start"

    def reclaim(self, wp):
        self.reclaimed.append(wp.worker_id)

    def signal(self, wp, sig):
        self.signals.append((wp.worker_id, sig))
        if sig == signal.SIGKILL:  # a stopped process takes only this one
            wp.proc.returncode = -sig


def restarter(workers, max_restarts=3, backoff_s=1.0, stopping=lambda: False, registered=lambda w: True):
    clock = SimpleNamespace(now=0.0)
    seen = []
    r = WorkerRestarter(workers, RestartPolicy(max_restarts, backoff_s, kill_grace_s=5.0), stopping=stopping,
                        on_exit=lambda wp, why: seen.append(("exit", wp.worker_id, why)),
                        on_restart=lambda old, new, n: seen.append(("restart", new.worker_id, old.exit_code, n)),
                        registered=registered, clock=lambda: clock.now)
    return r, clock, seen


def test_backoff_doubles_per_restart_of_a_worker_up_to_the_cap_and_stops_at_the_limit():
    policy = RestartPolicy(max_restarts=6, backoff_s=1.0, max_backoff_s=10.0)
    assert [policy.next_delay("a") for _ in range(7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, None]
    assert policy.next_delay("b") == 1.0  # counted per worker
    assert RestartPolicy(max_restarts=0).next_delay("a") is None


def test_an_exited_worker_is_declared_at_once_and_restarted_after_its_backoff_with_the_same_id():
    workers = FakeWorkers("rollout-0", "rollout-1")
    r, clock, seen = restarter(workers, backoff_s=1.0)
    workers.die("rollout-1", -9)
    r.check()
    assert seen == [("exit", "rollout-1", "its process (pid 101) exited with code -9")]
    assert workers.reclaimed == ["rollout-1"]  # what it left in shared memory goes at once
    assert workers.started == []  # waits its backoff first
    clock.now = 0.5
    r.check()
    assert workers.started == []
    clock.now = 1.0
    r.check()
    assert [wp.worker_id for wp in workers.started] == ["rollout-1"]
    assert seen[-1] == ("restart", "rollout-1", -9, 1)
    r.check()
    assert len(workers.started) == 1  # the new process is running: nothing more to do


def test_past_the_limit_the_error_names_the_worker_its_exit_code_and_its_log_tail():
    workers = FakeWorkers("rollout-0")
    r, clock, _ = restarter(workers, max_restarts=2, backoff_s=0.0)
    for _ in range(2):
        workers.die("rollout-0", 1)
        r.check()
    assert len(workers.started) == 2
    workers.die("rollout-0", 7)
    with pytest.raises(WorkerFailed) as failure:
        r.check()
    message = str(failure.value)
    assert "rollout-0" in message and "code 7" in message and "after 2 restarts" in message
    assert "/logs/rollout-0.log" in message and "RuntimeError: engine failed to start" in message


def test_nothing_is_restarted_once_the_run_is_shutting_down():
    workers = FakeWorkers("rollout-0")
    r, _, seen = restarter(workers, backoff_s=0.0, stopping=lambda: True)
    workers.die("rollout-0", 0)
    r.check()
    assert seen == [] and workers.started == []


def test_a_worker_declared_dead_whose_process_is_still_there_is_stopped_then_restarted():
    workers = FakeWorkers("rollout-0", "rollout-1")
    joined = set()
    r, clock, seen = restarter(workers, backoff_s=1.0, registered=lambda w: w in joined)
    assert not r.restarting("rollout")
    r.declared_dead("rollout-1", "no heartbeat for 10.7s (timeout 10.0s)")
    assert r.restarting("rollout") and not r.restarting("trainer")
    r.check()
    assert workers.signals == [("rollout-1", signal.SIGTERM)]  # asked first
    clock.now = 4.9
    r.check()
    assert workers.signals == [("rollout-1", signal.SIGTERM)]
    clock.now = 5.0
    r.check()  # ignored for the grace period: killed, then restarted like any worker that exited
    assert workers.signals[-1] == ("rollout-1", signal.SIGKILL)
    assert seen == [("exit", "rollout-1", "its process (pid 101) exited with code -9")]
    clock.now = 6.0
    r.check()
    assert [wp.worker_id for wp in workers.started] == ["rollout-1"] and r.restarting("rollout")
    joined.add("rollout-1")  # the new process registered: on its way no more
    assert not r.restarting("rollout")
    joined.clear()
    clock.now = 6.0 + 299.0
    assert r.restarting("rollout")
    clock.now = 6.0 + 300.0  # not registered within the start timeout: not coming
    assert not r.restarting("rollout")


def test_a_worker_whose_process_already_exited_or_a_run_shutting_down_is_not_signalled():
    workers = FakeWorkers("rollout-0")
    r, _, _ = restarter(workers, stopping=lambda: True)
    r.declared_dead("rollout-0", "left: shutdown")
    r.check()
    workers = FakeWorkers("rollout-0")
    r, _, _ = restarter(workers)
    workers.die("rollout-0", 0)
    r.declared_dead("rollout-0", "its process exited")
    r.check()
    assert workers.signals == []


def test_a_stopped_process_is_killed_after_the_grace_period(tmp_path):
    """A real process that handles SIGTERM (as a worker does), SIGSTOPped: the SIGTERM
    waits, never handled, and SIGKILL ends it once the grace period is over."""
    workers = LocalWorkers("tcp://127.0.0.1:1", tmp_path)
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); print(1, flush=True); " \
           "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"1\n"  # its handler is installed
        wp = WorkerProcess("rollout-0", "rollout", proc, None)
        workers.procs.append(wp)
        os.kill(proc.pid, signal.SIGSTOP)
        r = WorkerRestarter(workers, RestartPolicy(0, 0.0, kill_grace_s=0.2), stopping=lambda: False,
                            on_exit=lambda wp, why: None)
        r.declared_dead("rollout-0", "no heartbeat")
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            r._stop_hung(time.monotonic())
            time.sleep(0.05)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_restarted_process_takes_the_old_ones_place_and_appends_to_its_log(tmp_path):
    workers = LocalWorkers("tcp://127.0.0.1:1", tmp_path)
    old = WorkerProcess("rollout-0", "rollout", FakeProc(4242, -9), tmp_path / "rollout-0.log")
    old.log_path.write_text("first life\n")
    workers.procs.append(old)
    started = []

    def start(role, worker_id, gpus=None):  # in place of spawning a process
        started.append((role, worker_id))
        workers.procs.append(WorkerProcess(worker_id, role, FakeProc(4343), tmp_path / f"{worker_id}.log"))
        return workers.procs[-1]

    workers.start = start
    new = workers.restart(old)
    assert started == [("rollout", "rollout-0")]
    assert workers.procs == [new] and workers.retired == [old] and workers.pids() == [4343, 4242]
    assert old.log_path.read_text().startswith("first life\n")
    assert "pid 4242 exited with code -9; restarting" in workers.log_tail(new)


# --- pinning, with a stand-in for the process it would start -----------------------------


class FakePopen:
    started = []

    def __init__(self, cmd, env, **kwargs):
        self.cmd, self.env, self.pid = cmd, env, 4242
        FakePopen.started.append(self)

    def poll(self):
        return 0


def test_each_started_worker_is_pinned_to_its_own_gpus(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # what the launcher itself sees
    FakePopen.started.clear()
    workers = LocalWorkers("tcp://127.0.0.1:1")
    workers.start("rollout", "rollout-0", [1])
    workers.start("trainer", "trainer-0", [2, 3])
    workers.start("rollout", "rollout-1")  # no list: left as the environment has it
    envs = [proc.env for proc in FakePopen.started]
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "1" and envs[1]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert envs[0]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # numbers as nvidia-smi shows them
    assert envs[2]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_trainer_is_started_as_rank_0_of_a_group_of_the_configured_size(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    FakePopen.started.clear()
    workers = LocalWorkers("tcp://127.0.0.1:1", trainer_group_size=2)
    workers.start("trainer", "trainer-0", [2, 3])
    workers.start("rollout", "rollout-0", [0])
    trainer, rollout = (proc.cmd for proc in FakePopen.started)
    assert trainer[trainer.index("--group-size") + 1] == "2" and "--group-size" not in rollout


class LostWorker:
    """A worker of another launcher that ended without an exit code (its node is gone)."""

    def __init__(self, worker_id):
        self.worker_id, self.role, self.log_path, self.pid, self.exit_code = worker_id, "trainer", None, 77, None

    def alive(self):
        return False

    def ended(self):
        return "was lost with its node"

    def why_exited(self):
        return "its Ray actor (worker pid 77 on node n1) was lost with its node"


def test_a_worker_lost_without_an_exit_code_goes_through_the_same_policy_and_its_error_says_how_it_ended():
    workers = FakeWorkers()
    workers.procs = [LostWorker("trainer-0")]
    workers.exited = lambda: list(workers.procs)
    workers.restart = lambda old: workers.started.append(old) or old
    r, clock, seen = restarter(workers, max_restarts=1, backoff_s=0.0)
    r.check()
    assert seen == [("exit", "trainer-0", "its Ray actor (worker pid 77 on node n1) was lost with its node"),
                    ("restart", "trainer-0", None, 1)]
    with pytest.raises(WorkerFailed) as failure:
        r.check()
    assert "worker trainer-0 (trainer) was lost with its node after 1 restarts" in str(failure.value)
