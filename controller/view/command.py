"""`flexmarl view RUN_DIR [--host H] [--port P]`: the web view of a run directory, finished or
still being written, until Ctrl-C.

It prints the page's address and serves it (server.py), reading the run as it grows.
Loopback by default; another host needs a key in FLEXMARL_VIEW_KEY, as a running
controller's view does (`[view]`).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from flexmarl.runtime.config import ConfigError, ViewConfig

from .server import ViewServer

# What makes a directory a run directory to look at (any one of them).
RUN_FILES = ("events.log", "metrics.jsonl", "config.toml")


async def view(run_dir: str, host: str | None, port: int | None) -> int:
    """Serves until cancelled (0) or until the server stops on its own (1); 2: nothing to
    view or it cannot listen there."""
    path = Path(run_dir)
    if not any((path / name).exists() for name in RUN_FILES):
        print(f"flexmarl view: {run_dir} is not a run directory (none of {', '.join(RUN_FILES)} in it)",
              file=sys.stderr)
        return 2
    defaults = ViewConfig()
    cfg = ViewConfig(host=host or defaults.host, port=defaults.port if port is None else port)
    try:
        server = ViewServer(path, cfg)
        url = await server.start()
    except ConfigError as exc:  # a host off loopback without a key, a port taken
        print(f"flexmarl view: {exc}", file=sys.stderr)
        return 2
    print(f"viewing {path.resolve()} at {url} (Ctrl-C stops)", flush=True)
    try:
        assert server.task is not None  # start() made it
        await server.task
        return 1
    except asyncio.CancelledError:
        return 0
    finally:
        await server.stop()
