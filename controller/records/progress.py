"""Progress of the long parts of set-up (building a model, starting engines), shown as it goes.

    display = SetupProgress(enabled=True)
    with display.stage("building tiny:solver for agent solver") as stage:
        stage.update(120, 400)          # from any thread

On a terminal with the `rich` library installed, each stage is a live bar with its elapsed
time; elsewhere (a log file, a pipe, no rich) it is plain log lines: when the stage starts,
every `PLAIN_EVERY_S` seconds while it runs (with its count when known), and when it ends.
Disabled (`run.progress = false`), a stage logs its start and end only.

A child process's count (the model builder's warm-up steps) reaches its stage through
runtime/progress_file.py.

It does not know what the work is.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Iterator

log = logging.getLogger("flexmarl.setup")

PLAIN_EVERY_S = 10.0


class Stage:
    def __init__(self, description: str) -> None:
        self.description = description
        self.done: int | None = None
        self.total: int | None = None
        self.started = time.monotonic()
        self._task = None  # the rich task, if any

    def update(self, done: int, total: int | None = None) -> None:
        self.done, self.total = done, total if total is not None else self.total

    def counted(self) -> str:
        if self.done is None:
            return ""
        return f" {self.done}/{self.total}" if self.total else f" {self.done}"


class SetupProgress:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._rich = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    SpinnerColumn,
                    TextColumn,
                    TimeElapsedColumn,
                )
            except ImportError:
                pass
            else:
                self._rich = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                                      transient=False)

    @contextlib.contextmanager
    def stage(self, description: str) -> Iterator[Stage]:
        stage = Stage(description)
        stop = threading.Event()
        watcher = None
        if self._rich is not None:
            self._rich.start()
            stage._task = self._rich.add_task(description, total=None)
            watcher = threading.Thread(target=self._refresh_rich, args=(stage, stop), daemon=True)
        else:
            log.info("%s ...", description)
            if self.enabled:
                watcher = threading.Thread(target=self._plain_lines, args=(stage, stop), daemon=True)
        if watcher is not None:
            watcher.start()
        try:
            yield stage
        finally:
            stop.set()
            if watcher is not None:
                watcher.join()
            seconds = time.monotonic() - stage.started
            if self._rich is not None:
                self._rich.update(stage._task, completed=stage.done or stage.total or 1,
                                  total=stage.total or stage.done or 1)
                self._rich.stop()
                self._rich.remove_task(stage._task)  # shown once: the next stage starts a clean display
            log.info("%s: done in %.1fs", description, seconds)

    def _refresh_rich(self, stage: Stage, stop: threading.Event) -> None:
        assert self._rich is not None  # started only with a rich display
        while not stop.wait(0.2):
            if stage.done is not None:
                self._rich.update(stage._task, completed=stage.done, total=stage.total)

    def _plain_lines(self, stage: Stage, stop: threading.Event) -> None:
        while not stop.wait(PLAIN_EVERY_S):
            log.info("%s ...%s (%.0fs)", stage.description, stage.counted(), time.monotonic() - stage.started)

