"""Set-up progress: plain log lines where there is no terminal, a live display on one."""

import io
import logging

from flexmarl.controller.records import progress
from flexmarl.controller.records.progress import SetupProgress


def test_without_a_terminal_a_stage_is_logged_when_it_starts_and_ends(caplog):
    caplog.set_level(logging.INFO, logger="flexmarl.setup")
    with SetupProgress(enabled=True).stage("building model tiny:x for agent a") as stage:
        stage.update(3, 10)
        assert stage.counted() == " 3/10"
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "building model tiny:x for agent a ..."
    assert lines[-1].startswith("building model tiny:x for agent a: done in ")


def test_on_a_terminal_with_rich_a_stage_is_a_live_bar(monkeypatch):
    screen = io.StringIO()
    screen.isatty = lambda: True
    monkeypatch.setattr(progress.sys, "stderr", screen)
    display = SetupProgress(enabled=True)
    assert display._rich is not None
    display._rich.console.file = screen
    for name in ("building", "starting"):
        with display.stage(f"{name} things") as stage:
            stage.update(2, 4)
    shown = screen.getvalue()
    assert "building things" in shown and "starting things" in shown
    assert not display._rich.tasks  # each stage's bar is gone once shown
