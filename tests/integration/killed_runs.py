"""What the tests of a controller killed mid-run share: whether training reached a version
(read from the event log as it is written), and stopping the orphaned workers by PID; and
what the tests that act on a run in their own process share: waiting for its set-up."""

import asyncio
import os
import signal

from flexmarl.runtime import events as ev
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


async def set_up(exp, train):
    """Returns once the run's agents are placed and loaded; a run that stopped before that
    (`train`, its task, ended) raises its error here rather than leaving the wait endless."""
    while exp.training is None or not exp.training.parts.ready.is_set():
        if train.done():
            await train  # raises what stopped it
            raise AssertionError("the run ended before its set-up did")
        await asyncio.sleep(0.05)
