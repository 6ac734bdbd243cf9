"""What the tests of a controller killed mid-run share: starting `flexmarl run` in a process
of its own, killing it past a checkpoint, whether training reached a version (read from the
event log as it is written), and stopping the orphaned workers by PID; and what the tests
that act on a run in their own process share: a small job, training it here, waiting for
its set-up, and killing one of its workers."""

import asyncio
import os
import signal
import subprocess
import sys
import time

from flexmarl.controller import Experiment
from flexmarl.controller.tasks.digit_chain import default_config
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events


def trained_into(run_dir, version):
    """A micro-batch towards `version` is in the log (written as it goes, not only at steps)."""
    try:
        events, _ = read_events(run_dir / "events.log")
    except FileNotFoundError:
        return False
    return any(isinstance(e, ev.MicroBatchFormed) and e.version >= version for e in events)


def kill_workers_of(run_dir):
    """The killed controller's workers are orphans now: stop exactly those, by PID."""
    events, _ = read_events(run_dir / "events.log")
    for e in events:
        if isinstance(e, ev.WorkerJoined):
            try:
                os.kill(e.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def flexmarl_run(*args):
    """`flexmarl run ARGS` in a process of its own (one compute thread), its output in one pipe."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", "run", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout, tail=3000):
    """The output of `proc`, a `flexmarl_run`, which must exit with 0 within `timeout` seconds."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-tail:]
    return out


def kill_past_checkpoint(proc, run_dir, timeout, tail=3000):
    """Once the run of `proc` (a `flexmarl_run`) has its checkpoint of step 2 and trains
    towards version 3, kills its controller (SIGKILL, by its PID: no shutdown, no final flush)
    and then its orphaned workers; the run must not have finished by then."""
    checkpoint = run_dir / "checkpoints" / "step-000002" / "controller.json"
    deadline = time.monotonic() + timeout
    while not (checkpoint.exists() and trained_into(run_dir, 3)):  # mid-batch 3, past the checkpoint
        assert proc.poll() is None, proc.communicate()[0][-tail:]
        assert time.monotonic() < deadline, "no checkpoint of step 2 appeared"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    kill_workers_of(run_dir)
    assert not (run_dir / "checkpoints" / "final").exists(), "the run finished before it was killed"


def small_config(*overrides):
    """The built-in digit-chain job, small (3 steps of 4 queries, no progress line), with `overrides` after."""
    return load_config(None, ["run.steps=3", "pipeline.queries_per_step=4", "run.progress=false", *overrides],
                       defaults=default_config())


def run_training(cfg, run_dir, during=None, out=None):
    """Trains `cfg` in this process: (summary, worker pids). `during(exp, train)`, if given,
    is awaited once the training task (`train`) has started; `out`, a dict, also receives
    the TrainingRun as "training"."""
    async def main():
        async with Experiment(cfg, run_dir=run_dir) as exp:
            train = asyncio.create_task(exp.train())
            if during is not None:
                await during(exp, train)
            summary = await train
            if out is not None:
                out["training"] = exp.training
            return summary, exp.local.pids()

    return asyncio.run(main())


async def set_up(exp, train):
    """Returns once the run's agents are placed and loaded; a run that stopped before that
    (`train`, its task, ended) raises its error here rather than leaving the wait endless."""
    while exp.training is None or not exp.training.parts.ready.is_set():
        if train.done():
            await train  # raises what stopped it
            raise AssertionError("the run ended before its set-up did")
        await asyncio.sleep(0.05)


def kill_worker(exp, worker):
    """SIGKILL to exactly the process the launcher started as `worker`; returns its PID."""
    pid = next(wp.proc.pid for wp in exp.local.procs if wp.worker_id == worker)
    os.kill(pid, signal.SIGKILL)
    return pid
