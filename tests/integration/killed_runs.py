"""What the tests of a controller killed mid-run share: whether training reached a version
(read from the event log as it is written), and stopping the orphaned workers by PID."""

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
