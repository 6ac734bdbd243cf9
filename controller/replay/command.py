"""The `flexmarl replay` command: read the log, print the summary, write the trace and the
plot, and check the decisions when asked.

    flexmarl replay RUN_DIR [--trace FILE.json] [--plot FILE.png] [--check]
    flexmarl replay RUN_DIR/events.log ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flexmarl.runtime import collector
from flexmarl.runtime.eventlog import EventLogVersionError, read_events

from .checking import check_beside
from .lineage import lineage, lost_batches
from .summary import format_summary, summarize, write_plot, write_trace


def main(args: argparse.Namespace) -> int:
    """Exit codes: 0 fine, 1 the log is unreadable or inconsistent or the check found a
    difference. The events and then the summary are set apart from the collector once
    made (`collector.set_apart`): they are held to the end, and the check's collections
    need not walk them."""
    path = Path(args.log)
    if path.is_dir():  # a run directory: its log
        if not (path / "events.log").exists():
            print(f"flexmarl replay: {path} holds no events.log (is it a run directory? a run with "
                  f"run.event_log = false writes none)", file=sys.stderr)
            return 1
        path = path / "events.log"
    with collector.set_apart() as keep:
        try:
            events, problem = read_events(path)
        except (OSError, EventLogVersionError) as exc:
            print(f"flexmarl replay: {exc}", file=sys.stderr)
            return 1
        keep()
        if problem:
            # A torn last frame is expected after a crash; damage before it is read past.
            print(f"warning: read {len(events)} events: {problem}", file=sys.stderr)
        checked = check_beside(events) if getattr(args, "check", False) else None
        summary = summarize(events)
        keep()
        print(format_summary(summary))
        if getattr(args, "trace", None):
            write_trace(summary, args.trace)
            print(f"\ntrace written to {args.trace} (open it in https://ui.perfetto.dev)")
        if getattr(args, "plot", None):
            write_plot(summary, args.plot)
            print(f"plot written to {args.plot}")
        code = 0
        for error in summary.errors:
            print(f"ACCOUNTING FAILED: {error}", file=sys.stderr)
            code = 1
        if checked is not None:
            diff = checked()
            if diff is None:
                lost = sorted(lost_batches(lineage(events)))
                print("check: re-driving the decision code reproduces every logged decision"
                      + (" (the steps left open agree as far as the log goes)" if summary.open_steps else "")
                      + (f" (batches {', '.join(map(str, lost))} left out: damage to the log split their events)"
                         if lost else ""))
            else:
                print(f"CHECK FAILED: {diff}", file=sys.stderr)
                code = 1
        return code
