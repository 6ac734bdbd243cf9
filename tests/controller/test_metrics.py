"""The progress line: its time and ETA count training, not set-up (model builds, engine starts)."""

from flexmarl.controller.metrics import MetricsLog


def test_the_eta_counts_training_only(tmp_path, capsys):
    now = {"t": 0.0}
    metrics = MetricsLog(tmp_path, ["a"], clock=lambda: now["t"])
    now["t"] = 175.0  # set-up: models built, engines started
    metrics.training_started()
    now["t"] = 180.0
    metrics.write({"step": 1, "agent": "a", "reward_mean": 0.5})
    metrics.end_step(1, 4)
    metrics._fh.close()
    line = capsys.readouterr().err.strip()
    assert line.endswith("step 1/4  reward: a 0.500  5s training, ~15s left")
