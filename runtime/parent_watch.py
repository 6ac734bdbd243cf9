"""A child process that must not outlive its parent: `watch_parent(pid)`.

Workers that `flexmarl run` starts are in sessions of their own (a Ctrl-C reaches only the
controller, which shuts them down in order), so nothing stops them when the controller
dies without a word (SIGKILL, OOM). A daemon thread here looks every `interval_s` whether
the process's parent is still `pid` (a dead parent's children are handed to another
process); once it is not, the process is sent SIGTERM, its orderly exit, and ended with
`os._exit` if it is still there `grace_s` later (a main thread stuck in native code never
runs the handler).

It does not know what the process is doing or how it shuts down.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("flexmarl.parent_watch")

EXIT_ORPHANED = 4  # the exit status of a process ended because its parent died


def watch_parent(pid: int, interval_s: float = 0.5, grace_s: float = 5.0) -> threading.Thread:
    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(interval_s)
        log.warning("parent process %d is gone; exiting", pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
