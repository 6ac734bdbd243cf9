"""`flexmarl worker`'s process set-up around its session."""

import argparse

from flexmarl.runtime import collector
from flexmarl.workers import main as worker_main
from flexmarl.workers.session import WorkerSession


def test_a_worker_process_says_it_owns_its_heap_before_its_session_runs(monkeypatch):
    monkeypatch.setattr(collector, "_OWNS_HEAP", False)  # restored after the test: this process is pytest's
    seen = []

    async def run(self):
        seen.append(collector._OWNS_HEAP)
        return 0

    monkeypatch.setattr(WorkerSession, "run", run)
    parser = argparse.ArgumentParser()
    worker_main.add_arguments(parser)
    assert worker_main.run_worker(parser.parse_args(["--role", "env", "--connect", "tcp://127.0.0.1:1"])) == 0
    assert seen == [True]  # an engine it starts sets its heap apart (collector.building)
