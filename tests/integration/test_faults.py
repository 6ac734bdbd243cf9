"""Faults and mistakes in real runs (`flexmarl run` as a process: controller, workers, vLLM,
torch), with the job and the injections of flexmarl.controller.testing.faults: each is either mended
(the run finishes, nothing lost or trained twice) or stops with one line, last, that says
what to do; and the log replays.

- a dataset lacking the field every episode reads: one line naming the field;
- a run stopped by an error mid-step: its log replays with --check, the open step named;
- a flipped byte in an engine's weights in the newest checkpoint: named, and the resume
  falls back to the checkpoint before it (slow);
- a rollout worker stopped (SIGSTOP) for longer than the wait for an instance: killed,
  restarted, and the run finishes (slow);
- a rollout worker killed (SIGKILL), or stopped (SIGSTOP) past the heartbeat timeout, while
  its engine starts at set-up: the run goes on with the other, and the restarted process
  is admitted once it registers (slow);
- a full disk under the run directory (a small tmpfs mounted here), met by the event log or
  the metrics: one line with what to free and the resume command; once freed, the resume
  finishes (slow);
- the controller stopped (SIGSTOP) for four heartbeat timeouts while its pipeline waits for
  samples: every worker leaves and is restarted, the agent is restored from its checkpoint
  at once, the new rollout worker loads what exists (never the dead trainer's memory), and
  the run finishes (slow);
- damage in the middle of the event log (zeroed bytes with intact frames after them, or
  the second half cut off), then a resume: every intact frame is kept, the loss recorded,
  and replay's counts and check agree with the resumed run (slow);
- a flipped byte in the newest training state, met by a trainer restore during the run:
  said in one line, and the agent is restored from the checkpoint before it (slow);
- a text completion of 6 MiB sent with a live episode's key: refused at once, and the run
  (its heartbeats, its workers) goes on as if nothing happened (slow)."""

import argparse
import os
import random
import signal
import subprocess

from flexmarl.controller.testing import faults as fm
import pytest

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.checksums import read_manifest
from flexmarl.runtime.eventlog import read_events


def run_job(tmp_path, steps, *flags, field_name="prompt", extra_env=None, run_dir=None):
    job = fm.write_job(tmp_path / "job", steps, field_name)
    run_dir = run_dir or tmp_path / "run"
    return fm.start(job, run_dir, tmp_path / fm.STDERR, *flags, extra_env=extra_env), run_dir


def last_line(text):
    return [line for line in text.splitlines() if line.strip()][-1]


def assert_no_stray_tracebacks(text):
    for marker in fm.UNEXPECTED:
        assert marker not in text, text[-4000:]


def replay_check_args(run_dir):
    return argparse.Namespace(log=str(run_dir / "events.log"), trace=None, plot=None, check=True)


def sha256(path):
    from flexmarl.runtime.checksums import sha256_file

    return sha256_file(path)


def manifest_digest(run_dir, step):
    from flexmarl.runtime.checksums import read_manifest

    return read_manifest(run_dir / "checkpoints" / f"step-{step:06d}")["writer/model.safetensors"]


def test_a_dataset_lacking_the_field_every_episode_reads_stops_with_one_line_before_any_worker_starts(tmp_path):
    """Through the fault matrix's own run (its smoke run in the suite): the workflow reads
    "prompt" before its first agent call, so the dry read finds it; nothing starts and no
    run directory is left."""
    outcome = fm.run_with("missing-field", tmp_path, random.Random(0), steps=2)
    flow = tmp_path / "job" / "flow.py"
    assert last_line(outcome.stderr) == (
        f"flexmarl: data.train: no row has a field 'prompt', which the workflow reads (at {flow}:17 in episode); "
        "the rows' fields: 'question'. Add it to the data, or read a field the rows have")
    assert outcome.stderr.count("no row has a field") == 1 and "started rollout worker" not in outcome.stderr
    assert (outcome.codes, outcome.finished, outcome.lost, outcome.twice, outcome.tracebacks) == ([1], False, 0, 0, 0)
    assert outcome.check == "-" and outcome.last_line.startswith("flexmarl: data.train: no row has a field")
    assert fm.table([outcome]).splitlines()[2].startswith("| missing-field |  | stopped | 1 | - | 0 | 0 | - | 0 | 0 | - | ")
    assert not (tmp_path / "run").exists() and outcome.shm_left == 0


def test_a_run_stopped_by_an_error_mid_step_replays_with_check_its_open_step_named(tmp_path, capsys):
    controller, run_dir = run_job(tmp_path, 4, extra_env={"FAULT_FAIL_FROM": "3"})
    assert controller.wait() == 1
    err = controller.stderr()
    assert "the run cannot learn: 3 of the 4 episodes of step 3 failed" in err  # more than half stops it
    assert last_line(err).startswith("Fix the workflow")  # the error is the last thing printed
    assert_no_stray_tracebacks(err)
    events = fm.events(run_dir)
    assert replay.check(events) is None
    summary = replay.summarize(events)
    # async: the episodes of step 3 fail at once, while steps 1 and 2 are still rolling out or training
    assert summary.errors == [] and summary.open_steps["writer"]
    taken = {e.version for e in events if isinstance(e, ev.OptimizerStep)}
    assert set(summary.open_steps["writer"]) == {1, 2} - taken
    totals = {r.agent: r for r in summary.accounting if r.total}
    # the table and the accounting agree: 16 samples per step taken, those of open steps in flight
    assert summary.agents["writer"].samples_trained == totals["writer"].trained == 16 * len(taken)
    code = replay.main(replay_check_args(run_dir))
    out = capsys.readouterr().out
    assert code == 0 and "the log ends mid-step" in out and "steps left open agree" in out


@pytest.mark.slow
def test_a_flipped_byte_in_an_engines_weights_is_named_and_the_resume_falls_back_to_the_checkpoint_before(tmp_path):
    controller, run_dir = run_job(tmp_path, 3)
    assert controller.wait() == 0
    newest = run_dir / "checkpoints" / "step-000003" / "writer" / "model.safetensors"
    fm.flip_byte(newest)

    resumed = fm.resume(run_dir, tmp_path / "resumed.stderr", "--steps", "4")
    assert resumed.wait() == 0, resumed.stderr()[-3000:]
    err = resumed.stderr()
    assert f"the checkpoint of step 3 is damaged and is not resumed from: {newest} does not match" in err
    assert "resuming from the checkpoint of step 2 instead, the newest intact one" in err
    events = fm.events(run_dir)
    assert [e.step for e in events if isinstance(e, ev.RunResumed)] == [2]
    assert replay.check(events) is None and replay.summarize(events).errors == []
    assert (run_dir / "checkpoints" / "step-000004").is_dir()

    older = run_dir / "checkpoints" / "step-000002" / "writer" / "model.safetensors"
    fm.flip_byte(older)
    chosen = fm.resume(run_dir, tmp_path / "chosen.stderr", "--resume-from", "step-2", "--steps", "5")
    assert chosen.wait() == 1
    assert last_line(chosen.stderr()) == (
        f"flexmarl: the checkpoint of step 2 is damaged: {older} does not match its checksum in the checkpoint's "
        f"manifest (sha256 {sha256(older)[:12]}..., recorded {manifest_digest(run_dir, 2)[:12]}...): it was changed "
        "or damaged after it was written; resume from another (--resume-from step-N), or leave --resume-from out "
        "for the newest intact one")


@pytest.mark.slow
def test_a_rollout_worker_stopped_longer_than_the_instance_wait_is_replaced_and_the_run_finishes(tmp_path):
    steps = 40
    controller, run_dir = run_job(tmp_path, steps)
    stopped = None
    try:
        fm.wait_for(lambda: fm.last_step(run_dir) >= 1, controller, what="the first step")
        stopped = fm.workers(run_dir)["rollout-0"]
        os.kill(stopped, signal.SIGSTOP)  # never continued: on its own it would never come back
        assert controller.wait() == 0, controller.stderr()[-3000:]
    finally:
        if stopped is not None:
            fm.signal_pid(stopped, signal.SIGKILL)
    err = controller.stderr()
    assert "worker rollout-0 was declared dead (no heartbeat" in err and "is still there: stopping it" in err
    events = fm.events(run_dir)
    mine = [e for e in events if getattr(e, "worker", None) == "rollout-0"]
    died = next(e for e in mine if isinstance(e, ev.WorkerDied))
    restarted = next(e for e in mine if isinstance(e, ev.WorkerRestarted))
    assert "no heartbeat" in died.why and restarted.exit_code in (-signal.SIGTERM, -signal.SIGKILL)
    assert restarted.pid != stopped
    summary = replay.summarize(events)
    assert summary.errors == [] and replay.check(events) is None
    assert {e.version for e in events if isinstance(e, ev.OptimizerStep)} == set(range(1, steps + 1))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_rollout_worker_lost_while_its_engine_starts_at_set_up_is_replaced_and_the_run_finishes(tmp_path, sig):
    steps = 10
    # Each episode waits 1 s (an environment's latency): the run outlasts the replacement,
    # which rejoins seconds after the lost worker is found dead; without it the ten steps
    # of this job take well under a second once set-up ends.
    controller, run_dir = run_job(tmp_path, steps, "--set", "cluster.rollout_workers=2",
                                  extra_env={"FAULT_SLEEP_S": "1.0"})
    lost = None
    try:
        # Set-up begins right after RunStarted: the engines take seconds to start.
        fm.wait_for(lambda: any(isinstance(e, ev.RunStarted) for e in fm.events(run_dir)), controller,
                    what="set-up began")
        lost = fm.workers(run_dir)["rollout-1"]
        os.kill(lost, sig)
        assert controller.wait() == 0, controller.stderr()[-3000:]
    finally:
        if lost is not None:
            fm.signal_pid(lost, signal.SIGKILL)
    assert_no_stray_tracebacks(controller.stderr())
    events = fm.events(run_dir)
    placed = [e for e in events if isinstance(e, ev.AllocationChanged) and e.kind == "rollout"]
    assert not any(e.why == "rollout-1 joins: initial placement" for e in placed), "lost after set-up"
    restarted = next(e for e in events if isinstance(e, ev.WorkerRestarted) and e.worker == "rollout-1")
    assert restarted.pid != lost
    assert any(e.why == "rollout-1 rejoined" and "rollout-1" in e.workers for e in placed)
    summary = replay.summarize(events)
    assert summary.errors == [] and replay.check(events) is None
    assert {e.version for e in events if isinstance(e, ev.OptimizerStep)} == set(range(1, steps + 1))


@pytest.mark.slow
def test_a_full_disk_under_the_run_is_one_line_with_what_to_free_and_the_resume_finishes_once_freed(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        steps = 30
        # A checkpoint every 5 steps: what meets the full disk is a file written all along (the event
        # log, the metrics), not a checkpoint (refused before it starts, in a line of its own).
        controller, run_dir = run_job(tmp_path, steps, "--set", "run.checkpoint_every=5", run_dir=disk / "run")
        fm.wait_for(lambda: len(fm.checkpoints(run_dir)) >= 1, controller, what="a checkpoint")
        fm._fill_disk(controller, run_dir, tmp_path)
        assert controller.wait() == 1
        err = controller.stderr()
        assert_no_stray_tracebacks(err)
        line = last_line(err)
        point = max(int(p.name.removeprefix("step-")) for p in fm.checkpoints(run_dir))
        assert line.startswith(f"flexmarl: the disk holding {run_dir} is full (") and "MiB free): " in line
        assert line.endswith(f"Free some space there (earlier runs, or keep fewer checkpoints with "
                             f"run.keep_checkpoints), then `flexmarl run --resume {run_dir}` continues from the "
                             f"checkpoint of step {point}")
        assert err.count("is full (") == 1
        (disk / "filler").unlink()
        resumed = fm.resume(run_dir, tmp_path / "resumed.stderr")
        assert resumed.wait() == 0, resumed.stderr()[-3000:]
        events = fm.events(run_dir)
        assert replay.summarize(events).errors == [] and replay.check(events) is None
        assert (run_dir / "checkpoints" / "final").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def batch_started(run_dir, batch):
    return any(isinstance(e, ev.BatchStarted) and e.batch >= batch for e in fm.events(run_dir))


def checkpoint_written(run_dir, step):
    return any(isinstance(e, ev.CheckpointWritten) and e.step == step for e in fm.events(run_dir))


def assert_counts_and_check_agree(run_dir, steps):
    events = fm.events(run_dir)
    summary = replay.summarize(events)
    assert summary.errors == [] and summary.open_steps == {}
    assert replay.check(events) is None
    outcome = fm.judge(fm.Outcome("", codes=[0]), run_dir, steps)
    assert (outcome.finished, outcome.lost, outcome.twice, outcome.check) == (True, 0, 0, "ok")
    return events


@pytest.mark.slow
def test_a_controller_stalled_past_its_workers_timeout_gets_them_back_from_what_exists_and_finishes(tmp_path):
    steps = 10
    # Sync mode, episodes that wait: when the stall ends, the pipeline is waiting for samples
    # and the trainer holding its agent is gone with the others.
    controller, run_dir = run_job(tmp_path, steps, "--mode", "sync", extra_env={"FAULT_SLEEP_S": "1.5"})
    fm.wait_for(lambda: batch_started(run_dir, 4), controller, what="batch 4")
    fm._stall_controller(controller, run_dir, tmp_path)
    assert controller.wait() == 0, controller.stderr()[-3000:]
    err = controller.stderr()
    assert_no_stray_tracebacks(err)
    assert "the controller did not run for" in err and "the workers' silence is counted from now" in err
    assert "restoring its state of version 3" in err  # at once, not when a micro-batch next needs it
    rejoined = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "is gone; the publisher released it or exited" not in rejoined  # never the dead trainer's memory
    events = assert_counts_and_check_agree(run_dir, steps)
    assert sum(isinstance(e, ev.WorkerRestarted) for e in events) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["zero_middle", "halve"])
def test_damage_in_the_middle_of_the_event_log_costs_only_the_damage_and_the_resume_replays(tmp_path, damage):
    controller, run_dir = run_job(tmp_path, 6)
    assert controller.wait() == 0, controller.stderr()[-3000:]
    log = run_dir / "events.log"
    before, _ = read_events(log)
    getattr(fm, damage)(log)
    damaged, problem = read_events(log)
    intact = [e for e in damaged if not isinstance(e, ev.EventsLost)]
    resumed = fm.resume(run_dir, tmp_path / "resumed.stderr", "--steps", "8")
    assert resumed.wait() == 0, resumed.stderr()[-3000:]
    err = resumed.stderr()
    assert_no_stray_tracebacks(err)
    events = assert_counts_and_check_agree(run_dir, 8)
    after = [e for e in events if not isinstance(e, ev.EventsLost)]
    assert after[:len(intact)] == intact  # every intact frame kept, in place
    counted = replay.lineage(events)
    (lost,) = [e for e in counted if isinstance(e, ev.EventsLost)]  # found by the reader and recorded by the resume: once
    left_out = replay.lost_batches(counted)
    assert left_out and max(left_out) <= 6  # the batches it split, no more, none of the resumed run's
    stepped = {e.version for e in counted if isinstance(e, ev.OptimizerStep)}
    assert stepped == set(range(1, 9)) - left_out
    if damage == "zero_middle":
        assert f"byte offset {lost.offset}" in problem and lost.next_seq > lost.first_seq
        assert "the event log is damaged at" in err
    else:
        assert lost.next_seq == -1 and "before the checkpoint of step 6 this run resumes from" in err
    assert len(before) > len(intact)


@pytest.mark.slow
def test_a_damaged_training_state_met_by_a_restore_during_the_run_falls_back_to_the_checkpoint_before(tmp_path):
    steps = 10
    controller, run_dir = run_job(tmp_path, steps, "--mode", "sync", extra_env={"FAULT_SLEEP_S": "1.5"})
    fm.wait_for(lambda: checkpoint_written(run_dir, 4), controller, what="the checkpoint of step 4")
    state = run_dir / "checkpoints" / "step-000004" / "writer" / "training_state.flexmarl"
    fm.flip_byte(state)
    recorded = read_manifest(run_dir / "checkpoints" / "step-000004")["writer/training_state.flexmarl"]
    digests = sha256(state)[:12], recorded[:12]  # (the checkpoint is pruned by the end)
    fm.signal_pid(fm.workers(run_dir)["trainer-0"], signal.SIGKILL)
    assert controller.wait() == 0, controller.stderr()[-3000:]
    err = controller.stderr()
    assert_no_stray_tracebacks(err)
    said = [line for line in err.splitlines() if "is damaged and is not restored from" in line]
    assert len(said) == 1 and said[0].endswith(
        f"writer: the checkpoint of step 4 is damaged and is not restored from: {state} does not match its checksum "
        f"in the checkpoint's manifest (sha256 {digests[0]}..., recorded {digests[1]}...): it was changed or damaged "
        "after it was written; restoring from the checkpoint of step 3 instead, the newest intact one")
    events = assert_counts_and_check_agree(run_dir, steps)
    assert [(e.version, e.batch) for e in events if isinstance(e, ev.TrainingRestored)] == [(3, 5)]


@pytest.mark.slow
def test_a_six_mib_request_with_an_episodes_key_is_refused_at_once_and_the_run_goes_on(tmp_path):
    outcome = fm.run_with("large-request", tmp_path, random.Random(0), steps=12)
    assert "answered 400" in outcome.at, outcome.at
    assert (outcome.codes, outcome.finished, outcome.lost, outcome.twice, outcome.check, outcome.tracebacks) == (
        [0], True, 0, 0, "ok", 0), outcome.stderr[-3000:]
    err = (tmp_path / fm.STDERR).read_text()
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert "controller silent" not in logs and "controller silent" not in err  # its heartbeats went on
