"""Experiment trackers: where a run's metrics rows go besides metrics.jsonl.

`TRACKERS` maps a `run.trackers` name to a class; each takes the run directory, the
config (as a plain dict) and the agents, and receives every metrics row (`log(row)`:
one agent's optimizer step, or one evaluation), the sample texts of a step when
`run.samples_per_step` asks for them (`log_samples(step, agent, rows)`, see sample_log.py)
and `close()` at the end. Rows are
written under `AGENT/KEY`, with each agent on its own step axis, since agents step
independently in async mode.

- tensorboard: event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`).
- wandb: Weights & Biases, offline unless WANDB_MODE says otherwise: files in RUN_DIR/wandb,
  uploaded later with `wandb sync` where a network is reachable.

Both libraries are imported only when asked for. This module does not know where rows
come from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Protocol

from flexmarl.runtime.config import TRACKERS as TRACKER_NAMES


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    skip = {"step", "agent", "version", "time", "kind"}
    return {k: float(v) for k, v in row.items()
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _tag(row: dict[str, Any], key: str) -> str:
    prefix = f"{row['agent']}/eval" if row.get("kind") == "eval" else row["agent"]
    return f"{prefix}/{key}"


def _conversation(row: dict[str, Any]) -> str:
    return "\n".join(f"{t['role']}" + (f" (v{t['version']})" if t.get("version") is not None else "")
                     + f": {t['text']}" for t in row["turns"])


def _samples_markdown(rows: list[dict[str, Any]]) -> str:
    return "\n\n".join(f"**{r['sample_id']}** reward {r['reward']:.3f}\n\n    "
                         + _conversation(r).replace("\n", "\n    ") for r in rows)


class Tracker(Protocol):
    """An experiment tracker: every metrics row (metrics.py) and the samples logged
    (sample_log.py) go to each one the run opened."""

    def log(self, row: dict[str, Any]) -> None: ...

    def log_samples(self, step: int, agent: str, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any], agents: list[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, row: dict[str, Any]) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(_tag(row, key), value, global_step=row["step"])

    def log_samples(self, step: int, agent: str, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text(f"{agent}/samples", _samples_markdown(rows), global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any], agents: list[str]) -> None:
        import wandb

        mode: Any = os.environ.get("WANDB_MODE", "offline")  # wandb validates it
        self.run = wandb.init(project=config.get("run", {}).get("wandb_project", "flexmarl"), dir=str(run_dir),
                              mode=mode, config=config, reinit="create_new")
        for agent in agents:  # each agent on its own step axis
            self.run.define_metric(f"{agent}/step")
            self.run.define_metric(f"{agent}/*", step_metric=f"{agent}/step")

    def log(self, row: dict[str, Any]) -> None:
        data = {_tag(row, k): v for k, v in _scalars(row).items()}
        data[f"{row['agent']}/step"] = row["step"]
        self.run.log(data)

    def log_samples(self, step: int, agent: str, rows: list[dict[str, Any]]) -> None:
        import wandb

        table = wandb.Table(columns=["step", "sample_id", "reward", "versions", "conversation"],
                            data=[[r["step"], r["sample_id"], r["reward"], str(r["versions"]), _conversation(r)]
                                  for r in rows])
        self.run.log({f"{agent}/samples": table, f"{agent}/step": step})

    def close(self) -> None:
        self.run.finish()


TRACKERS: dict[str, Callable[[Path, dict[str, Any], list[str]], Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
assert set(TRACKERS) == set(TRACKER_NAMES), "runtime.config.TRACKERS lists the trackers the config accepts"


def open_trackers(names: list[str], run_dir: Path, config: dict[str, Any], agents: list[str]) -> list[Tracker]:
    return [TRACKERS[name](Path(run_dir), config, agents) for name in names]
