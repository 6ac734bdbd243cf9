"""Checkpoints as consistent cuts: staged, renamed once complete, the last N kept, a failed
one leaving the previous whole. The trainer's side is a fake that writes a directory."""

import collections
import json
import os

import pytest

from flexmarl.controller.control.server import RemoteError
from flexmarl.controller.train.checkpoints import (
    Checkpointer,
    CheckpointError,
    check_writable,
    latest_checkpoint,
    step_dir_name,
    truncate_metrics,
)
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol as p

AGENTS = ["planner", "solver"]


class FakeTrainers:
    """Writes what a trainer would (a directory with a weights file) or fails like one."""

    def __init__(self):
        self.fail_with = None
        self.rid = 0

    def next_request_id(self):
        self.rid += 1
        return self.rid

    async def call(self, worker, msg):
        assert isinstance(msg, p.SaveCheckpoint) and msg.full_state
        if self.fail_with:
            raise RemoteError(self.fail_with)
        os.makedirs(msg.path)
        with open(os.path.join(msg.path, "model.safetensors"), "wb") as f:
            f.write(b"w" * 1000)
        return p.CheckpointSaved(msg.request_id, msg.agent, msg.path, 0, None, 1000), []


def checkpointer(tmp_path, server, every=2, keep=2, steps=10):
    events = []
    ck = Checkpointer(tmp_path / "checkpoints", AGENTS, every=every, keep=keep, steps=steps, server=server,
                      emit=events.append, controller_state=lambda step: {"versions": {a: step for a in AGENTS}})
    return ck, events


async def save_step(ck, step):
    for agent in AGENTS:
        await ck.save_agent(agent, "trainer-0", step)


async def test_a_checkpoint_appears_only_once_every_agent_saved_its_step(tmp_path):
    ck, events = checkpointer(tmp_path, FakeTrainers())
    await ck.save_agent("planner", "trainer-0", 2)
    assert latest_checkpoint(tmp_path) is None  # half a cut is never resumed from
    assert (tmp_path / "checkpoints" / ".step-000002.partial" / "planner").is_dir()
    await ck.save_agent("solver", "trainer-0", 2)
    point = latest_checkpoint(tmp_path)
    assert point.step == 2 and point.state["versions"] == {"planner": 2, "solver": 2}
    assert (point.path / "solver" / "model.safetensors").exists()
    assert not (tmp_path / "checkpoints" / ".step-000002.partial").exists()
    assert [type(e) for e in events] == [ev.CheckpointWritten] and events[0].nbytes == 2000


async def test_only_the_newest_checkpoints_are_kept_and_final_points_at_the_last_step(tmp_path):
    ck, _ = checkpointer(tmp_path, FakeTrainers(), every=2, keep=2, steps=7)
    assert [s for s in range(1, 8) if ck.due(s)] == [2, 4, 6, 7]
    for step in (2, 4, 6, 7):
        await save_step(ck, step)
    root = tmp_path / "checkpoints"
    assert sorted(d.name for d in root.iterdir()) == ["final", step_dir_name(6), step_dir_name(7)]
    assert os.readlink(root / "final") == step_dir_name(7)
    assert latest_checkpoint(tmp_path).step == 7


async def test_a_failed_checkpoint_leaves_the_previous_one_whole_and_says_so(tmp_path):
    server = FakeTrainers()
    ck, _ = checkpointer(tmp_path, server)
    await save_step(ck, 2)
    before = sorted(str(f) for f in (tmp_path / "checkpoints").rglob("*"))
    await ck.save_agent("planner", "trainer-0", 4)
    server.fail_with = "SaveCheckpoint for solver failed: OSError('No space left on device')"
    with pytest.raises(CheckpointError) as info:
        await ck.save_agent("solver", "trainer-0", 4)
    message = str(info.value)
    assert "step 4" in message and "No space left" in message
    assert "step 2" in message and "--resume" in message
    assert sorted(str(f) for f in (tmp_path / "checkpoints").rglob("*")) == before  # nothing half-written
    assert latest_checkpoint(tmp_path).step == 2


async def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    ck, _ = checkpointer(tmp_path, FakeTrainers())
    await save_step(ck, 2)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(CheckpointError, match="MiB free, the last checkpoint took"):
        await ck.save_agent("planner", "trainer-0", 4)
    assert not (tmp_path / "checkpoints" / ".step-000004.partial").exists()


def test_an_unwritable_run_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="not writable.*--out"):
        check_writable(blocker / "run")


def test_a_run_directory_without_room_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="MiB free"):
        check_writable(tmp_path, need_bytes=2**62)


def test_resuming_cuts_the_metrics_back_to_the_checkpoint(tmp_path):
    rows = [{"step": 1, "agent": "a"}, {"kind": "eval", "step": 2, "agent": "a"}, {"step": 2, "agent": "a"},
            {"step": 3, "agent": "a"}, {"kind": "eval", "step": 1, "agent": "a"}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "ag')  # torn by the crash
    truncate_metrics(path, 2)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    # training rows up to the checkpoint; evaluations before it (one at the step is redone)
    assert kept == [rows[0], rows[2], rows[4]]


async def test_a_trainer_dying_mid_save_leaves_the_cut_open_for_the_agent_to_save_again(tmp_path):
    from flexmarl.controller.control.server import WorkerDied

    class DyingOnce(FakeTrainers):
        async def call(self, worker, msg):
            if msg.agent == "solver" and not getattr(self, "died", False):
                self.died = True
                raise WorkerDied(worker, "killed")
            return await super().call(worker, msg)

    ck, _ = checkpointer(tmp_path, DyingOnce())
    await ck.save_agent("planner", "trainer-0", 2)
    with pytest.raises(WorkerDied):  # not a checkpoint failure: the pipeline restores the agent
        await ck.save_agent("solver", "trainer-0", 2)
    assert (tmp_path / "checkpoints" / ".step-000002.partial" / "planner").is_dir()  # kept
    await ck.save_agent("solver", "trainer-1", 2)  # restored elsewhere, stepped again, saved
    assert latest_checkpoint(tmp_path).step == 2


async def test_resuming_what_cannot_be_resumed_says_why_before_anything_starts(tmp_path):
    from flexmarl.controller.run.experiment import Experiment
    from flexmarl.controller.tasks.digit_chain import default_config
    from flexmarl.runtime.config import dump_toml, load_config

    with pytest.raises(CheckpointError, match="not a run directory"):
        Experiment.resuming(tmp_path / "nothing-here")
    cfg = load_config(None, ["run.steps=4"], defaults=default_config())
    (tmp_path / "config.toml").write_text(dump_toml(cfg))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        async with Experiment.resuming(tmp_path, spawn_workers=False):
            pass
    ck, _ = checkpointer(tmp_path, FakeTrainers(), every=2, steps=4)
    for step in (2, 4):
        await save_step(ck, step)
    with pytest.raises(CheckpointError, match="is finished.*larger run.steps"):
        async with Experiment.resuming(tmp_path, spawn_workers=False):
            pass
    longer = Experiment.resuming(tmp_path, overrides=["run.steps=8"], spawn_workers=False)
    assert longer.config.run.steps == 8 and longer.resume


@pytest.fixture
def models_named(monkeypatch):
    """Model names resolved to directories named after them, without building anything."""
    from flexmarl.controller.run import components

    monkeypatch.setattr(components, "resolve_model", lambda name, *_: f"/models/{name.replace(':', '-')}")
    monkeypatch.setattr(components, "has_tokenizer", lambda path: False)


def test_after_a_resume_engines_started_later_load_the_model_not_the_pruned_checkpoint(tmp_path, models_named):
    """A worker that rejoins (or an instance moved to another agent) long after the resume
    starts from the model's own weights and is synced to the current version: the
    checkpoint the run resumed from may be pruned by then."""
    from types import SimpleNamespace

    from flexmarl.controller.run.training import TrainingRun
    from flexmarl.controller.tasks.digit_chain import default_config
    from flexmarl.controller.train.checkpoints import ResumePoint
    from flexmarl.runtime.config import load_config

    cfg = load_config(None, ["run.steps=8", "run.progress=false"], defaults=default_config())
    server = SimpleNamespace(on_died=[], on_joined=[], closing=False, next_request_id=lambda: 1)
    point = ResumePoint(tmp_path / "checkpoints" / "step-000004", 4, {})
    run = TrainingRun(cfg, server, tmp_path, emit=lambda e: None, flush_events=None,
                      worker_ids=lambda role: [], resume=point)
    message = run.parts.load_message("planner")
    assert (message.model_path, message.version) == ("/models/tiny-planner", 0)
    assert run.parts.schedule.first_batch == 5 and run.parts.versions["planner"] == 4
    run.parts.metrics.close()
    run.parts.tools.shutdown()


def training_run(tmp_path, *overrides, resume=None):
    """A TrainingRun over a 10-row dataset, not started (no workers): what a resume decides
    before anything runs."""
    import json
    from types import SimpleNamespace

    from flexmarl.controller.run.training import TrainingRun
    from flexmarl.runtime.config import load_config

    rows = tmp_path / "rows.jsonl"
    if not rows.exists():
        rows.write_text("".join(json.dumps({"q": i}) + "\n" for i in range(10)))
    cfg = load_config(None, [f"data.train='{rows}'", "pipeline.queries_per_step=3", "agents.a.model=tiny:planner",
                             "run.progress=false", *overrides])
    server = SimpleNamespace(on_died=[], on_joined=[], registry=None)

    async def flush():
        pass

    (tmp_path / "run").mkdir(exist_ok=True)
    return TrainingRun(cfg, server, tmp_path / "run", emit=lambda e: None, flush_events=flush,
                       worker_ids=lambda role: [], resume=resume)


def test_a_resume_continues_the_dataset_at_the_next_row(tmp_path, models_named):
    from flexmarl.controller.train.checkpoints import ResumePoint

    first = training_run(tmp_path)
    state = first.parts.checkpoints.controller_state(2)  # the checkpoint of step 2: episodes 0-5 used
    rows_of_batch_3 = [first.parts.resolved.dataset.item(first.parts.episodes.episode_number(3, i)) for i in range(3)]
    resumed = training_run(tmp_path, resume=ResumePoint(tmp_path, 2, state))
    assert [resumed.parts.resolved.dataset.item(resumed.parts.episodes.episode_number(3, i)) for i in range(3)] == rows_of_batch_3
    assert resumed.parts.resolved.dataset.position(resumed.parts.episodes.episode_number(3, 0)).index == state["data"]["next_row"]
    # With a batch size changed (and accepted), the data still goes on at the saved row, none skipped.
    point = ResumePoint(tmp_path, 2, state, accept_changes=True)
    bigger = training_run(tmp_path, "pipeline.queries_per_step=4", resume=point)
    assert [bigger.parts.episodes.episode_number(b, 0) for b in (3, 4)] == [6, 10]


@pytest.mark.parametrize("override, named", [("run.seed=3", "run.seed was 0, now 3"),
                                             ("pipeline.queries_per_step=4", "pipeline.queries_per_step was 3"),
                                             ("data.shuffle=false", "data.shuffle was True, now False")])
def test_a_resume_that_changes_a_setting_exactness_depends_on_is_refused_naming_it(tmp_path, override, named, models_named):
    from flexmarl.controller.train.checkpoints import ResumePoint

    state = training_run(tmp_path).parts.checkpoints.controller_state(2)
    with pytest.raises(CheckpointError, match=named) as refused:
        training_run(tmp_path, override, resume=ResumePoint(tmp_path, 2, state))
    assert "--resume-anyway" in str(refused.value)
    training_run(tmp_path, override, resume=ResumePoint(tmp_path, 2, state, accept_changes=True))  # as told
    training_run(tmp_path, "run.steps=40", resume=ResumePoint(tmp_path, 2, state))  # --steps: always


def test_a_resume_on_changed_rows_is_refused(tmp_path, models_named):
    from flexmarl.controller.train.checkpoints import ResumePoint

    state = training_run(tmp_path).parts.checkpoints.controller_state(2)
    (tmp_path / "rows.jsonl").write_text("".join('{"q": %d}\n' % (i + 1) for i in range(10)))
    with pytest.raises(CheckpointError, match=r"data.train \(its rows\) was"):
        training_run(tmp_path, resume=ResumePoint(tmp_path, 2, state))


def test_a_resume_places_the_units_as_at_the_checkpoint_only_on_the_same_workers(tmp_path):
    from flexmarl.controller.train.checkpoints import ResumePoint, resume_placement
    from flexmarl.runtime.bases import EngineUnit, Units

    units = Units({"w": EngineUnit("w", ("w",)), "bases.b": EngineUnit("bases.b", ("x", "y"), lora=True)})
    point = ResumePoint(tmp_path, 2, {"rollout_assignment": {"w": ["r1"], "x": ["r0", "r2"], "y": ["r0", "r2"]}})
    assert resume_placement(point, units, ["r2", "r0", "r1"]) == {"w": ["r1"], "bases.b": ["r0", "r2"]}
    assert resume_placement(point, units, ["r0", "r1", "r3"]) is None  # another worker: placed anew
    assert resume_placement(None, units, ["r0", "r1", "r2"]) is None


def test_a_resumed_whole_model_engine_starts_on_the_checkpoint_and_an_adapter_base_on_its_model(tmp_path):
    from flexmarl.controller.train.checkpoints import ResumePoint, at_checkpoint
    from flexmarl.runtime.bases import EngineUnit

    point = ResumePoint(tmp_path / "step-000003", 3, {})
    whole, base = EngineUnit("w", ("w",)), EngineUnit("bases.b", ("x",), lora=True)
    message = whole.load_message(1, "/models/w", seed=0)
    resumed = at_checkpoint(message, point, whole)
    assert (resumed.model_path, resumed.version) == (str((tmp_path / "step-000003" / "w").resolve()), 3)
    assert at_checkpoint(message, None, whole) is message
    base_message = base.load_message(1, "/models/b", seed=0)
    assert at_checkpoint(base_message, point, base) is base_message


def test_a_checkpoint_names_frozen_agents_by_their_source_and_snapshots_by_their_version():
    from flexmarl.controller.train.checkpoints import frozen_sources
    from flexmarl.runtime.config import load_config

    cfg = load_config(None, ["agents.p.model='tiny:planner'", "agents.j.model='tiny:checker'", "agents.j.train=false",
                             "agents.s.snapshot_of='p'", "agents.s.snapshot_every=3"])
    assert frozen_sources(cfg, {"s": 6}) == {"j": {"model": "tiny:checker"},
                                             "s": {"snapshot_of": "p", "every": 3, "version": 6}}


CONTINUOUS = ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.in_flight=keep",
              "pipeline.admission=continuous", "pipeline.partial_rollout=1", "pipeline.max_concurrent_episodes=6",
              "run.steps=4"]


class HeldEpisodes:
    """A workflow whose episodes end when the test says (the name of each begun, and its
    row, recorded in the order they begin)."""

    def __init__(self, hold=True):
        import asyncio

        self.hold = hold
        self.begun = []  # (episode, row index)
        self.release = collections.defaultdict(asyncio.Event)

    async def __call__(self, ctx):
        self.begun.append((ctx.episode_id, ctx.item.index))
        if self.hold:
            await self.release[ctx.episode_id].wait()


async def settle():
    import asyncio

    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_continuous_checkpoint_records_its_episodes_in_flight_and_a_resume_begins_exactly_those_again(
        tmp_path, models_named):
    import asyncio

    from flexmarl.controller.train.checkpoints import ResumePoint

    first = training_run(tmp_path, *CONTINUOUS)
    episodes, schedule = first.parts.episodes, first.parts.schedule
    episodes.workflow = held = HeldEpisodes()
    producing = asyncio.ensure_future(episodes.run())
    await settle()
    assert [name for name, _ in held.begun] == ["s1q0", "s1q1", "s1q2", "s1p0", "s2q0", "s2q1"]
    for name in ("s1q0", "s2q0", "s1p0"):  # the first three to end fill batch 1; s1q1 and s1q2 carry over
        held.release[name].set()
        await settle()
    schedule.agent_stepped(1)  # batch 1 trained (the one agent stepped and synced)
    held.release["s1q1"].set()  # ends after: batch 2 takes it
    await settle()
    state = first.parts.checkpoints.controller_state(1)
    producing.cancel()
    await asyncio.gather(producing, return_exceptions=True)

    dataset = first.parts.resolved.dataset
    trained = {"s1q0", "s2q0", "s1p0"}
    begun = [name for name, _ in held.begun]
    record = state["episodes"]
    assert state["admission"] == "continuous"
    assert [b["name"] for b in record["in_flight"]] == [n for n in begun if n not in trained]
    assert {b["name"]: b["assigned"] for b in record["in_flight"]}["s1q1"] == 2
    assert all(b["assigned"] is None for b in record["in_flight"] if b["name"] != "s1q1")
    for b in record["in_flight"]:  # each by its dataset row
        assert b["row"] == [dataset.position(b["number"]).epoch, dataset.item(b["number"]).index]
    assert begun[-1] == "s3q2" and record["next"] == [4, 0] and record["spares_begun"] == 1

    resumed = training_run(tmp_path, *CONTINUOUS, resume=ResumePoint(tmp_path, 1, state))
    resumed.parts.episodes.workflow = again = HeldEpisodes(hold=False)
    await resumed.parts.episodes.run()  # every episode ends at once: each batch's count is met
    assert [n for n, _ in again.begun][:len(record["in_flight"])] == [b["name"] for b in record["in_flight"]]
    rows_before = dict(held.begun)
    assert all(rows_before[n] == row for n, row in again.begun if n in rows_before)  # the same rows, redrawn
    everything = [n for n in begun if n in trained] + [n for n, _ in again.begun]
    assert sorted(everything) == sorted([f"s{b}q{i}" for b in range(1, 5) for i in range(3)] + ["s1p0"])
    assert all(resumed.parts.schedule.rollout_complete(b) for b in range(2, 5))  # the last took the spare's place


def test_a_continuous_checkpoint_resumed_under_step_admission_is_refused_naming_the_fix(tmp_path, models_named):
    from flexmarl.controller.train.checkpoints import ResumePoint
    from flexmarl.runtime.config import ConfigError

    state = training_run(tmp_path, *CONTINUOUS).parts.checkpoints.controller_state(1)
    with pytest.raises(ConfigError, match=r"resume it with --set pipeline.admission=continuous"):
        training_run(tmp_path, *[o for o in CONTINUOUS if "admission" not in o and "partial" not in o],
                     resume=ResumePoint(tmp_path, 1, state))
    del state["episodes"]  # written before the episodes in flight were recorded
    with pytest.raises(ConfigError, match=r"without its episodes in flight"):
        training_run(tmp_path, *CONTINUOUS, resume=ResumePoint(tmp_path, 1, state))
    step = training_run(tmp_path).parts.checkpoints.controller_state(1)  # a step checkpoint: continues either way
    assert "episodes" not in step
    assert training_run(tmp_path, *CONTINUOUS, resume=ResumePoint(tmp_path, 1, step)).parts.schedule.first_batch == 2


def test_a_capacity_checkpoint_records_its_episodes_and_resumes_under_continuous_or_capacity_only(
        tmp_path, models_named):
    from flexmarl.controller.train.checkpoints import ResumePoint
    from flexmarl.runtime.config import ConfigError

    capacity = [o.replace("=continuous", "=capacity") for o in CONTINUOUS]
    run = training_run(tmp_path, *capacity)
    assert run.parts.schedule.drained is not None  # the instances' owner counts its drained instances
    assert training_run(tmp_path, *CONTINUOUS).parts.schedule.drained is None
    state = run.parts.checkpoints.controller_state(1)
    assert state["admission"] == "capacity" and "episodes" in state
    with pytest.raises(ConfigError, match=r"resume it with --set pipeline.admission=capacity"):
        training_run(tmp_path, *[o for o in capacity if "admission" not in o and "partial" not in o],
                     resume=ResumePoint(tmp_path, 1, state))
    assert training_run(tmp_path, *CONTINUOUS, resume=ResumePoint(tmp_path, 1, state)).parts.schedule.first_batch == 2


async def test_a_continuous_runs_final_checkpoint_resumed_for_more_steps_over_provisions_its_spare_again(
        tmp_path, models_named):
    from flexmarl.controller.train.checkpoints import ResumePoint

    first = training_run(tmp_path, *CONTINUOUS)
    first.parts.episodes.workflow = HeldEpisodes(hold=False)
    await first.parts.episodes.run()
    state = first.parts.checkpoints.controller_state(4)
    assert state["episodes"]["in_flight"] == [] and state["episodes"]["spares_over"] == 0  # the last batch took all

    longer = training_run(tmp_path, *CONTINUOUS, "run.steps=6", resume=ResumePoint(tmp_path, 4, state))
    longer.parts.episodes.workflow = again = HeldEpisodes(hold=False)
    await longer.parts.episodes.run()
    assert sorted(n for n, _ in again.begun) == sorted([f"s{b}q{i}" for b in (5, 6) for i in range(3)] + ["s5p1"])
    assert all(longer.parts.schedule.rollout_complete(b) for b in (5, 6))
