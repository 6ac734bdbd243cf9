"""Each agent's curves, read from metrics.jsonl (records/metrics.py writes it): a point per
optimizer step, and a point per evaluation (`"kind": "eval"` rows, the held-out reward).

A step's samples/s is the samples it trained over the seconds since the agent's step
before it (`time` counts from the controller's start; the first step of a process, whose
time before it includes set-up, uses the step's own `step_s`). Every other curve is a
column of the row as written; a row without it leaves a gap.
"""

from __future__ import annotations

import math
from typing import Any

# The page's curves: name -> the metrics row's key it reads.
COLUMNS = {"reward": "reward_mean", "staleness": "staleness_mean", "staleness_max": "staleness_max",
           "mismatch": "logprob_abs_diff", "rollout_kl": "rollout_kl", "loss": "loss", "grad_norm": "grad_norm",
           "entropy": "entropy", "time": "time"}
CURVES = ("samples_s", *COLUMNS)


class AgentCurves:
    """Rows of metrics.jsonl as columns: `train` and `eval`, each a dict of lists (`agent`
    an index into `agents`, `step`, and the `CURVES`), appended to as the file grows."""

    def __init__(self) -> None:
        self.agents: list[str] = []
        self._index: dict[str, int] = {}
        self.train: dict[str, list[Any]] = {k: [] for k in ("agent", "step", *CURVES)}
        self.eval: dict[str, list[Any]] = {k: [] for k in ("agent", "step", "reward")}
        self._last_time: dict[str, float] = {}

    def agent(self, name: str) -> int:
        if name not in self._index:
            self._index[name] = len(self.agents)
            self.agents.append(name)
        return self._index[name]

    def add(self, row: dict[str, Any]) -> None:
        agent, step = row.get("agent"), row.get("step")
        if not isinstance(agent, str) or not isinstance(step, int):
            return
        if row.get("kind") == "eval":
            for key, value in (("agent", self.agent(agent)), ("step", step), ("reward", _number(row.get("reward_mean")))):
                self.eval[key].append(value)
            return
        if row.get("kind") is not None:  # a kind of row this view does not know
            return
        train = self.train
        train["agent"].append(self.agent(agent))
        train["step"].append(step)
        train["samples_s"].append(self._samples_per_s(agent, row))
        for curve, key in COLUMNS.items():
            train[curve].append(_number(row.get(key)))

    def _samples_per_s(self, agent: str, row: dict[str, Any]) -> float | None:
        samples, now = _number(row.get("samples")), _number(row.get("time"))
        before = self._last_time.get(agent)
        if now is not None:
            self._last_time[agent] = now
        seconds = now - before if now is not None and before is not None and now > before else _number(row.get("step_s"))
        return round(samples / seconds, 3) if samples is not None and seconds else None

    def since(self, train: int, evals: int) -> dict[str, Any]:
        """The columns from row `train` (and eval row `evals`) on."""
        return {"agents": self.agents, "train_rows": len(self.train["step"]), "eval_rows": len(self.eval["step"]),
                "train": {k: v[train:] for k, v in self.train.items()},
                "eval": {k: v[evals:] for k, v in self.eval.items()}}

    def latest(self) -> dict[str, dict[str, Any]]:
        """agent -> its last training row's step and curves."""
        last: dict[str, dict[str, Any]] = {}
        train = self.train
        for i in range(len(train["step"]) - 1, -1, -1):
            name = self.agents[train["agent"][i]]
            if name not in last:
                last[name] = {k: train[k][i] for k in ("step", *CURVES)}
                if len(last) == len(self.agents):
                    break
        return last

    def last_step(self) -> int:
        return max(self.train["step"], default=0)


def _number(value: Any) -> float | None:
    """A finite number, or None (JSON has no NaN; a missing value is a gap)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value
