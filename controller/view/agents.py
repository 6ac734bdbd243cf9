"""Each agent's curves, read from metrics.jsonl (records/metrics.py writes it): a point per
optimizer step, and a point per evaluation (`"kind": "eval"` rows, the held-out reward).

A step's samples/s is what the agent trained over its last `WINDOW` steps (this one
included) over the seconds they took: from the end of the step before them (`time`
counts seconds since the controller started) or, for the first ones, from when its first
step began (its `time` less its `step_s`, so set-up is not counted). Over one step alone
the rate jumps wherever an agent takes two steps close together after waiting (async
pipelines do). Every other curve is a column of the row as written; a row without it
leaves a gap.
"""

from __future__ import annotations

import math
from typing import Any

# The page's curves: name -> the metrics row's key it reads.
COLUMNS = {"reward": "reward_mean", "staleness": "staleness_mean", "staleness_max": "staleness_max",
           "mismatch": "logprob_abs_diff", "rollout_kl": "rollout_kl", "loss": "loss", "grad_norm": "grad_norm",
           "entropy": "entropy", "time": "time"}
CURVES = ("samples_s", *COLUMNS)
WINDOW = 5  # steps the samples/s curve is taken over


class AgentCurves:
    """Rows of metrics.jsonl as columns: `train` and `eval`, each a dict of lists (`agent`
    an index into `agents`, `step`, and the `CURVES`), appended to as the file grows."""

    def __init__(self) -> None:
        self.agents: list[str] = []
        self._index: dict[str, int] = {}
        self.train: dict[str, list[Any]] = {k: [] for k in ("agent", "step", *CURVES)}
        self.eval: dict[str, list[Any]] = {k: [] for k in ("agent", "step", "reward")}
        self._recent: dict[str, list[tuple[float, float]]] = {}  # agent -> (time, samples) of its last steps
        self._began: dict[str, float] = {}  # agent -> when its first step began

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
        if samples is None or now is None:
            return None
        recent = self._recent.setdefault(agent, [])
        if recent and now < recent[-1][0]:  # a resumed run's clock starts again
            recent.clear()
            self._began.pop(agent, None)
        if agent not in self._began:
            self._began[agent] = now - (_number(row.get("step_s")) or 0.0)
        recent.append((now, samples))
        if len(recent) > WINDOW + 1:
            del recent[0]
        window = recent[-WINDOW:]
        start = recent[0][0] if len(recent) > WINDOW else self._began[agent]
        seconds = now - start
        return round(sum(n for _, n in window) / seconds, 3) if seconds > 0 else None

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
