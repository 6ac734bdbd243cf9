"""Run outputs a person reads: metrics.jsonl, a progress line per step, reward plots.

metrics.jsonl holds one JSON object per agent per optimizer step with at least `step`,
`agent`, `version`, `reward_mean`, `samples` and `time` (seconds since the run started),
plus the signals a researcher reads to trust a run: the trained samples' staleness (mean,
max), the stage times, and the trainer's step statistics (loss, grad_norm, entropy,
response lengths, logprob_abs_diff and rollout_kl between sampler and trainer, clip_frac,
ref_kl, teacher_kl, teacher_top_kl) and the step's failed episodes (`episodes_failed`). With the rollout's prompt
counts, each row also says what the agent's engines prefilled since its last row:
`prompt_tokens`, `cached_prompt_tokens` (found in the prefix cache) and the hit rates of
first turns (`prefix_hit_rate`) and of later turns of conversations (`turn_prefix_hit_rate`). Evaluations add rows with
`"kind": "eval"`. Each line is flushed as it is written, so a crashed run keeps every
finished step. With a sample log (sample_log.py), each step's trained samples go to it.
The progress line's time and ETA count from `training_started()` (after set-up).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from flexmarl.runtime.atomic import replace_atomically


if TYPE_CHECKING:
    from .sample_log import SampleLog
    from .trackers import Tracker

log = logging.getLogger("flexmarl.metrics")


class MetricsLog:
    def __init__(self, run_dir: str | Path, agents: Iterable[str], progress: bool = True,
                 trackers: Iterable[Tracker] = (), *, resumed: bool = False, first_step: int = 1,
                 clock: Callable[[], float] = time.monotonic, sample_log: SampleLog | None = None,
                 prompt_counts: Callable[[str], dict[str, int]] | None = None) -> None:
        self.sample_log = sample_log  # sample_log.py: given every step's trained samples
        self.prompt_counts = prompt_counts  # agent -> the rollout's prompt counts so far (RolloutClient)
        self._counted: dict[str, dict[str, int]] = {}  # agent -> those counts at its last row
        self.first_step = first_step  # the first step this process trains (later after a resume)
        self.run_dir = Path(run_dir)
        self.trackers = list(trackers)  # see trackers.py: each gets every row
        self.agents = list(agents)
        self.progress = progress
        self.clock = clock
        self.started = clock()
        self.training_from: float | None = None  # set-up done (models built, engines up)
        path = self.run_dir / "metrics.jsonl"
        # A resumed run continues the file (already cut back to the checkpoint); a new
        # run in a reused directory starts it afresh.
        self.rows: list[dict[str, Any]] = ([json.loads(line) for line in path.read_text().splitlines() if line]
                                           if resumed and path.exists() else [])
        self._fh = open(path, "a" if resumed else "w", buffering=1)
        self._durable = -1  # rows on disk as of the last make_durable
        self._durable_lock = asyncio.Lock()

    def record(self, step: int, agent: str, version: int, trained: list[Any], times: Any, **extra: Any) -> None:
        """The step's row; `trained`: its micro-batches (store.MicroBatch: `rewards()`,
        `oldest()`, `keys()`)."""
        rewards = [r for mb in trained for r in mb.rewards()]
        trained_version = version - 1  # a sample's lag (`decisions.lag`): that less its oldest version
        lags = [trained_version - v for mb in trained for v in mb.oldest()]
        row = {"step": step, "agent": agent, "version": version,
               "reward_mean": math.fsum(rewards) / len(rewards) if rewards else None,
               "samples": len(rewards), "time": round(self.clock() - self.started, 3),
               "staleness_mean": round(sum(lags) / len(lags), 3) if lags else None,
               "staleness_max": max(lags) if lags else None,
               **{k: round(v, 4) for k, v in vars(times).items()}, **self._prefill(agent), **extra}
        self.write(row)
        if self.sample_log is not None:
            self.sample_log.record(step, agent, [key for mb in trained for key in mb.keys()])

    def _prefill(self, agent: str) -> dict[str, Any]:
        """The agent's prompt tokens and prefix-cache hits since its last row."""
        if self.prompt_counts is None:
            return {}
        now = dict(self.prompt_counts(agent))
        last = self._counted.get(agent, {})
        d = {k: v - last.get(k, 0) for k, v in now.items()}
        self._counted[agent] = now
        rate = lambda cached, prompt: round(cached / prompt, 4) if prompt else None  # noqa: E731
        return {"prompt_tokens": d["prompt_tokens"] + d["turn_prompt_tokens"],
                "cached_prompt_tokens": d["cached_tokens"] + d["turn_cached_tokens"],
                "prefix_hit_rate": rate(d["cached_tokens"], d["prompt_tokens"]),
                "turn_prefix_hit_rate": rate(d["turn_cached_tokens"], d["turn_prompt_tokens"])}

    def write(self, row: dict[str, Any]) -> None:
        """One row to metrics.jsonl (flushed) and to every tracker."""
        self.rows.append(row)
        self._fh.write(json.dumps(row) + "\n")
        for tracker in self.trackers:
            tracker.log(row)

    async def make_durable(self) -> None:
        """Every row written so far is on disk (before a checkpoint that follows them). The
        disk is waited for off the event loop (an fsync can take a tenth of a second), and
        once for every agent that checkpoints the same step."""
        async with self._durable_lock:
            written = len(self.rows)
            if self._durable == written:
                return
            self._fh.flush()
            await asyncio.to_thread(os.fsync, self._fh.fileno())
            self._durable = written

    def end_step(self, step: int, total: int) -> None:
        if self.sample_log is not None:  # every agent stepped: the frozen agents' samples of the step
            self.sample_log.record_served(step)
        if not self.progress:
            return
        last = {r["agent"]: r["reward_mean"] for r in self.rows if r["step"] == step and "kind" not in r}
        rewards = "  ".join(f"{a} {last[a]:.3f}" if last.get(a) is not None else f"{a} -" for a in self.agents)
        training = self.clock() - (self.training_from if self.training_from is not None else self.started)
        width = 20
        done = int(width * step / total)
        bar = "#" * done + "." * (width - done)
        eta = training / max(1, step - self.first_step + 1) * (total - step)
        print(f"[{bar}] step {step}/{total}  reward: {rewards}  "
              f"{training:.0f}s training, ~{eta:.0f}s left", file=sys.stderr, flush=True)

    def training_started(self) -> None:
        """Set-up is over: the progress line's time and ETA count from here."""
        self.training_from = self.clock()

    def reward_history(self) -> dict[str, list[float]]:
        return {a: [r["reward_mean"] for r in self.rows
                    if r["agent"] == a and r["reward_mean"] is not None and "kind" not in r]
                for a in self.agents}

    def record_eval(self, step: int, agent: str, samples: list[Any], failed: int, episodes: int,
                    versions: dict[str, list[int]] | None = None) -> dict[str, Any]:
        """One evaluation row (`"kind": "eval"`): held-out rewards at the weights after `step`;
        `versions`: every agent's policy versions its evaluation samples ran under."""
        rewards = [s.reward for s in samples if s.reward is not None]
        row = {"kind": "eval", "step": step, "agent": agent,
               "version": min((min(s.versions) for s in samples if s.versions), default=None),
               "versions": versions or {},
               "reward_mean": math.fsum(rewards) / len(rewards) if rewards else None, "samples": len(rewards),
               "episodes": episodes, "episodes_failed": failed,
               "time": round(self.clock() - self.started, 3)}
        self.write(row)
        return row

    def eval_line(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self.progress:
            rewards = "  ".join(f"{r['agent']} {r['reward_mean']:.3f}" if r["reward_mean"] is not None
                                else f"{r['agent']} -" for r in rows)
            print(f"eval after step {step}: reward {rewards}", file=sys.stderr, flush=True)

    async def aclose(self) -> None:
        """`close` off the event loop: drawing the reward plot takes about a second with
        many agents, and a tracker's close may wait on the network."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self._fh.close()
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:  # a tracker must never turn a finished run into a failure
                log.exception("could not close the %s tracker", type(tracker).__name__)
        if self.rows:
            try:
                plot_rewards(self.rows, self.agents, self.run_dir / "rewards.png")
            except Exception as exc:  # a plot must never turn a finished run into a failure
                log.warning("could not draw the reward plot (%s); the previous one, if any, is kept", exc)


LEGEND_INSIDE = 8  # legend entries drawn inside the axes; more go beside them


def plot_rewards(rows: list[dict[str, Any]], agents: list[str], path: Path) -> None:
    from matplotlib.figure import Figure  # not pyplot: its figure registry is global state, and this may run in a thread

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for agent in agents:
        mine = [r for r in rows if r["agent"] == agent and r["reward_mean"] is not None]
        pts = [(r["step"], r["reward_mean"]) for r in mine if "kind" not in r]
        evals = [(r["step"], r["reward_mean"]) for r in mine if r.get("kind") == "eval"]
        if pts:
            line, = ax.plot(*zip(*pts), marker="o", markersize=3, label=agent)
            if evals:
                ax.plot(*zip(*evals), linestyle="--", marker="s", markersize=4, color=line.get_color(),
                        label=f"{agent} (eval)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title("reward per agent")
    ax.grid(alpha=0.3)
    entries = len(ax.get_legend_handles_labels()[0])
    if entries > LEGEND_INSIDE:  # many agents: the legend beside the axes, in columns, the figure wider for it
        columns = math.ceil(entries / 2 / LEGEND_INSIDE)
        fig.set_size_inches(7 + 1.5 * columns, 4)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), ncol=columns, fontsize="x-small")
    elif entries:
        ax.legend()
    fig.tight_layout()
    replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
