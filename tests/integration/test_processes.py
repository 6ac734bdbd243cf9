"""A real controller and real worker processes over real ZeroMQ."""

import asyncio
import gc
import os
import signal
import time
import weakref

import pytest

from flexmarl.controller.launch.launcher import WorkerFailed
from flexmarl.controller.run.experiment import Experiment
from flexmarl.controller.tasks.digit_chain import default_config
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol as p
from flexmarl.runtime.aio import TaskEnded
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); the launcher reaps its children, so check status
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_three_workers_run_commands_one_is_killed_and_declared_dead_then_all_shut_down(tmp_path):
    cfg = load_config(None, ["cluster.rollout_workers=2", "cluster.trainer_workers=1",
                             "transport.heartbeat_interval_s=0.2", "transport.heartbeat_timeout_s=2.0",
                             "cluster.worker_start_timeout_s=60",
                             "cluster.max_restarts=0"],  # the dead one stays dead here
                      defaults=default_config())
    async with Experiment(cfg, run_dir=tmp_path) as exp:
        pids = exp.local.pids()
        assert len(pids) == 3 and all(_alive(pid) for pid in pids)
        ids = exp.worker_ids("rollout") + exp.worker_ids("trainer")
        assert ids == ["rollout-0", "rollout-1", "trainer-0"]
        for worker_id in ids:
            rid = exp.server.next_request_id()
            reply, buffers = await exp.server.call(worker_id, p.Echo(rid, worker_id.encode()),
                                                   [b"x" * 1000], timeout=10)
            assert reply.payload == worker_id.encode() and len(buffers[0]) == 1000

        victim = exp.local.procs[1]
        killed_at = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        while exp.server.registry.workers[victim.worker_id].alive:
            assert time.monotonic() - killed_at < cfg.transport.heartbeat_timeout_s + 2.0, \
                "killed worker was not declared dead within the heartbeat timeout"
            await asyncio.sleep(0.05)
        assert sorted(w.worker_id for w in exp.server.registry.alive()) == ["rollout-0", "trainer-0"]
        rid = exp.server.next_request_id()
        reply, _ = await exp.server.call("trainer-0", p.Echo(rid, b"still"), timeout=10)
        assert reply.payload == b"still"
    assert not any(_alive(pid) for pid in pids), "a worker process outlived the experiment"
    codes = [wp.proc.returncode for wp in exp.local.procs]
    assert codes[0] == 0 and codes[2] == 0, f"survivors should exit cleanly on SHUTDOWN: {codes}"


async def test_a_killed_worker_is_started_again_under_its_id_and_past_the_limit_the_run_stops_naming_it(tmp_path):
    cfg = load_config(None, ["cluster.rollout_workers=1", "cluster.trainer_workers=1",
                             "transport.heartbeat_interval_s=0.2", "transport.heartbeat_timeout_s=2.0",
                             "cluster.worker_start_timeout_s=60", "cluster.max_restarts=1",
                             "cluster.restart_backoff_s=0.1"], defaults=default_config())

    async def registered_again(exp, old_pid):
        while True:
            info = exp.server.registry.workers["rollout-0"]
            if info.alive and info.pid != old_pid:
                return info
            await asyncio.sleep(0.05)

    async with Experiment(cfg, run_dir=tmp_path) as exp:
        first = exp.local.procs[0]
        assert first.worker_id == "rollout-0"
        os.kill(first.proc.pid, signal.SIGKILL)  # exactly the process the launcher started
        info = await asyncio.wait_for(registered_again(exp, first.proc.pid), 60)
        second = exp.local.procs[0]
        assert info.pid == second.proc.pid != first.proc.pid and not _alive(first.proc.pid)
        reply, _ = await exp.server.call("rollout-0", p.Echo(exp.server.next_request_id(), b"back"), timeout=10)
        assert reply.payload == b"back"

        os.kill(second.proc.pid, signal.SIGKILL)  # a second death is past max_restarts = 1
        with pytest.raises(TaskEnded) as ended:
            await exp.supervise(asyncio.Event().wait, name="idle")
        failure = ended.value.cause
        assert isinstance(failure, WorkerFailed) and ended.value.name == "launcher"
        assert "worker rollout-0 (rollout) exited with code -9 after 1 restarts" in str(failure)
        assert str(tmp_path / "logs" / "rollout-0.log") in str(failure)
    assert not any(_alive(pid) for pid in exp.local.pids()), "a worker process outlived the experiment"
    events, _ = read_events(tmp_path / "events.log")
    restarts = [e for e in events if isinstance(e, ev.WorkerRestarted)]
    assert [(e.worker, e.exit_code, e.restarts, e.pid) for e in restarts] == [
        ("rollout-0", -signal.SIGKILL, 1, second.proc.pid)]
    log_text = (tmp_path / "logs" / "rollout-0.log").read_text()
    assert f"pid {first.proc.pid} exited with code -9; restarting" in log_text


class Held:
    """Stands for an episode's HTTP client: a cycle whose memory (its certificate store,
    allocated by OpenSSL) the collector does not count."""

    def __init__(self) -> None:
        self.me = self


async def test_an_open_experiment_frees_within_seconds_a_cycle_that_died_old_and_hands_back_its_start_up_heap(tmp_path):
    cfg = load_config(None, ["cluster.rollout_workers=1", "cluster.trainer_workers=1",
                             "cluster.worker_start_timeout_s=60"], defaults=default_config())
    async with Experiment(cfg, run_dir=tmp_path):
        assert gc.get_freeze_count() > 0  # the start-up heap, walked by no collection
        held = Held()
        gone = weakref.ref(held)
        gc.collect(1)  # alive through the younger passes: it ages into the oldest generation
        del held
        gc.collect(1)
        assert gone() is not None  # where only a full collection reaches it
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while gone() is not None:
            assert loop.time() < deadline, "a cycle that died old outlived 30 s of an open experiment"
            await asyncio.sleep(0.1)
    assert gc.get_freeze_count() == 0
