"""A real headless browser for the web view's tests and bench, and `flexmarl view` as a
process beside it.

`headless_chromium()` runs scripts/headless_chromium.sh (it unpacks the Chromium build of
the npm package @sparticuz/chromium into the user's cache folder once) and returns the
launcher to hand Playwright as `executable_path`; where node or npm is missing it raises
`BrowserMissing`, which a test turns into a skip that says so. `ViewProcess` starts
`flexmarl view RUN_DIR` on a free loopback port, reads the address it prints, and stops
exactly the process it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "headless_chromium.sh"
NO_TOOLS = 3  # the script's exit code when node or npm is missing


class BrowserMissing(RuntimeError):
    """No headless browser can be had here (node or npm is missing)."""


def headless_chromium(timeout: float = 600.0) -> str:
    """The path of a headless Chromium launcher (unpacked on first use, then cached)."""
    if not SCRIPT.exists():
        raise BrowserMissing(f"{SCRIPT} is not here (FlexMARL installed without its scripts)")
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=timeout)
    if done.returncode == NO_TOOLS:
        raise BrowserMissing(done.stderr.strip())
    if done.returncode != 0:
        raise RuntimeError(f"{SCRIPT} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


class ViewProcess:
    """`flexmarl view RUN_DIR` in a process of its own; `url` once it listens."""

    def __init__(self, run_dir: str | Path, timeout: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.errors = tempfile.TemporaryFile("w+")  # its standard error, read if it fails to start
        self.proc = subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", "view", str(run_dir), "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=self.errors, text=True,
                                     env=env if env is not None else dict(os.environ))
        assert self.proc.stdout is not None  # piped above
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline and self.proc.poll() is None and " at http" not in line:
            line = self.proc.stdout.readline()
        if " at http" not in line:
            self.errors.seek(0)
            said = self.errors.read()[-2000:]
            self.stop()
            raise RuntimeError(f"flexmarl view did not start: {line!r} {said}")
        self.url = "http" + line.rsplit(" at http", 1)[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # our own child, by its handle
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.errors.close()

    def __enter__(self) -> "ViewProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
