"""`flexmarl replay`: a run read back from its event log, and its decisions re-driven.

    summary.py      the summary (workers' busy and idle time, per-agent throughput, the
                    staleness histogram, accounting), the Perfetto trace and the plot
    accounting.py   every sample generated once, then trained, dropped or in flight once
    lineage.py      the events the final state descends from (undone work left out)
    redrive.py      the controller's own decision code fed the logged inputs
    checking.py     `--check`: the re-drive compared with the log
    command.py      the command itself

Used by the command line, the benches and the web view (view/cluster.py reads the
summary's usage rules a part of the log at a time, also in a running controller's own
view); the controller's training code never imports it. The names below are the
package's API for scripts and tests.
"""

from .checking import check, check_beside
from .command import main
from .lineage import lineage
from .summary import Summary, format_summary, summarize, trace_json, training_seconds, write_plot, write_trace

__all__ = ["Summary", "check", "check_beside", "format_summary", "lineage", "summarize", "trace_json",
           "main", "training_seconds", "write_plot", "write_trace"]
