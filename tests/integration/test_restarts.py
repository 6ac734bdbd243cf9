"""Workers that die come back, with real processes over real ZeroMQ: the local launcher
starts a killed rollout worker again and it rejoins the run; a worker registers again with
a controller started again on its address."""

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import sys

import pytest
import zmq

from flexmarl.controller import Experiment, replay
from flexmarl.controller.control.server import ControllerServer
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.eventlog import read_events
from killed_runs import kill_worker, set_up, small_config

AGENTS = ("planner", "solver", "checker")
STEPS = 3


@pytest.mark.slow
def test_a_killed_rollout_worker_is_restarted_rejoins_and_the_run_trains_every_batch(tmp_path):
    # Three rollout workers for three agents: the victim is its agent's only instance, so
    # the run can only finish if the restarted process rejoins and serves that agent.
    cfg = small_config(f"run.steps={STEPS}", "pipeline.mode='async'", "cluster.restart_backoff_s=0.2")
    killed = {}

    async def kill_the_solver_instance_mid_batch(exp, train):
        await set_up(exp, train)
        instances = exp.training.parts.instances
        victim = instances.assignment["solver"][0]
        while instances.outstanding[victim] <= 0:  # requests in flight on it: mid-run
            await asyncio.sleep(0.005)
        killed.update(worker=victim, pid=kill_worker(exp, victim))  # exactly the process the launcher started

    async def main():
        async with Experiment(cfg, run_dir=tmp_path) as exp:
            train = asyncio.create_task(exp.train())
            await kill_the_solver_instance_mid_batch(exp, train)
            summary = await train
            now = next(wp for wp in exp.local.procs if wp.worker_id == killed["worker"])
            return summary, now.proc.pid, exp.training.parts.instances.assignment, exp.training.parts.rejoin.rejoined

    summary, new_pid, assignment, rejoined = asyncio.run(main())
    victim = killed["worker"]
    assert new_pid != killed["pid"] and victim in assignment["solver"]
    assert [(w, a) for w, a, _ in rejoined] == [(victim, "solver")]
    assert all(len(summary.rewards[a]) == STEPS for a in AGENTS), "every batch trains every agent"

    events, problem = read_events(tmp_path / "events.log")
    assert problem is None
    mine = [e for e in events if getattr(e, "worker", None) == victim]
    kinds = [type(e).__name__ for e in mine if isinstance(e, (ev.WorkerJoined, ev.WorkerDied, ev.WorkerRestarted))]
    assert kinds[:4] == ["WorkerJoined", "WorkerDied", "WorkerRestarted", "WorkerJoined"]
    restarted = next(e for e in mine if isinstance(e, ev.WorkerRestarted))
    assert (restarted.exit_code, restarted.restarts, restarted.pid) == (-signal.SIGKILL, 1, new_pid)
    back = next(e.seq for e in events if isinstance(e, ev.AllocationChanged) and e.why == f"{victim} rejoined")
    assert any(isinstance(e, ev.RequestsDispatched) and e.worker == victim and e.seq > back for e in events), \
        "the restarted instance served requests after it rejoined"
    trained = [s for e in events if isinstance(e, ev.MicroBatchFormed) for s in e.parts.samples()]
    assert len(trained) == len(set(trained)), "a sample trained twice"
    steps = collections.Counter(e.agent for e in events if isinstance(e, ev.OptimizerStep))
    assert steps == {a: STEPS for a in AGENTS}
    result = replay.summarize(events)
    assert result.errors == []
    totals = {r.agent: r for r in result.accounting if r.total}
    assert all(totals[a].generated == totals[a].trained + totals[a].dropped > 0 for a in AGENTS)
    assert replay.main(argparse.Namespace(log=str(tmp_path / "events.log"), trace=None, plot=None, check=True)) == 0


async def test_a_worker_process_registers_again_with_a_controller_started_again_on_its_address(tmp_path):
    cfg = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5)
    first = ControllerServer(cfg)
    address = first.bind()
    tasks = [asyncio.create_task(first.serve()), asyncio.create_task(first.heartbeat())]
    log_path = tmp_path / "t0.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flexmarl.workers.main", "--role", "trainer",
                                 "--connect", address, "--worker-id", "t0", "--reconnect-timeout", "40"],
                                env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    second = None
    try:
        await first.wait_for_workers({"trainer": 1}, 40)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        first.close()  # the controller is gone; the worker keeps running

        second = ControllerServer(TransportConfig(address=address, heartbeat_interval_s=0.2,
                                                  heartbeat_timeout_s=1.5))
        for _ in range(50):  # the old socket's port may take a moment to be free
            try:
                second.bind()
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.1)
        tasks = [asyncio.create_task(second.serve()), asyncio.create_task(second.heartbeat())]
        await second.wait_for_workers({"trainer": 1}, 40)
        info = second.registry.workers["t0"]
        assert info.pid == proc.pid and proc.poll() is None, "the same process registered again"
        reply, _ = await second.call("t0", p.Echo(second.next_request_id(), b"back"), timeout=10)
        assert reply.payload == b"back"
        await second.broadcast_shutdown("test over")
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if second is not None:
            second.close()
    assert "trying to register again" in log_path.read_text()
