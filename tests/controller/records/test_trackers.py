"""Metrics rows reach TensorBoard and Weights & Biases (offline) when the config asks."""

import types

from flexmarl.controller.records.metrics import MetricsLog
from flexmarl.controller.records.trackers import open_trackers
from flexmarl.runtime.keys import GroupKey


def rows():
    """A micro-batch of one sample (what a step's row is made of), and the step's times."""
    sample = types.SimpleNamespace(rewards=lambda: [1.0], oldest=lambda: [0], keys=lambda: [])
    times = types.SimpleNamespace(rollout_s=0.1, train_s=0.2, sync_s=0.01)
    return sample, times


def test_tensorboard_receives_each_agents_rows_on_its_own_step_axis(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = MetricsLog(tmp_path, ["a", "b"], progress=False,
                         trackers=open_trackers(["tensorboard"], tmp_path, {}, ["a", "b"]))
    sample, times = rows()
    for step in (1, 2):
        metrics.record(step, "a", step, [sample], times, grad_norm=0.5 * step)
    metrics.record(1, "b", 1, [sample], times)
    metrics.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("a/grad_norm")] == [1, 2]
    assert [e.value for e in acc.Scalars("a/grad_norm")] == [0.5, 1.0]
    assert [e.value for e in acc.Scalars("b/reward_mean")] == [1.0]


def test_wandb_writes_an_offline_run_with_the_rows(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    metrics = MetricsLog(tmp_path, ["a"], progress=False,
                         trackers=open_trackers(["wandb"], tmp_path, {"run": {"wandb_project": "t"}}, ["a"]))
    sample, times = rows()
    metrics.record(1, "a", 1, [sample], times, grad_norm=0.25)
    metrics.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
    assert b"a/grad_norm" in data and b"a/reward_mean" in data


def test_sample_texts_reach_tensorboard_and_wandb(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flexmarl.controller.records.sample_log import SampleLog

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = open_trackers(["tensorboard", "wandb"], tmp_path, {"run": {"wandb_project": "t"}}, ["a"])
    log = SampleLog(tmp_path, 1, {}, trackers)
    said = types.SimpleNamespace(sample_id="g/0", key=GroupKey("e", "a", "g"), member=0, batch=1, prompt_ids=[], output_ids=[], mask=[], versions=[0],
                                 token_versions=[], reward=1.0, messages=[{"role": "user", "content": "What is 7 + 5?"},
                                                       {"role": "assistant", "content": "twelve"}])
    log.group_ready("a", "g", [said])
    log.record(1, "a", ["g"])
    for tracker in trackers:
        tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (text,) = acc.Tensors("a/samples/text_summary")
    assert b"assistant (v0): twelve" in text.tensor_proto.string_val[0]
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    # The table's own file (written when it is logged); the run's record of it is written
    # by W&B's service process, which may still be at it after finish() returns.
    tables = [p.read_bytes() for p in run.rglob("*.table.json")]
    assert any(b"twelve" in t and b"What is 7 + 5?" in t for t in tables)
