"""A run directory followed as it grows: what the web view knows of a run.

`RunWatch.refresh()` reads what the run wrote since the last call, a bounded slice of the
event log at a time, and hands it to the parts that keep what the pages show: each
agent's curves (metrics.jsonl: agents.py), the cluster (the event log: cluster.py) and
the samples and episodes (the event log and samples.jsonl: episodes.py). A finished run
is read once; a live one a little more each call; nothing is read twice. A file that
started over under it (a resumed run rewrites metrics.jsonl and samples.jsonl, a new run
in the same directory replaces everything) is read again from its start, and `epoch`
counts those times so a page knows to drop what it had.

It reads the run directory only: the event log, metrics.jsonl, samples.jsonl and
config.toml (the resolved config). It knows no sockets and no HTTP.
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path
from typing import Any

from flexmarl.runtime.events import RunStarted

from .agents import AgentCurves
from .cluster import HAPPENINGS, ClusterView
from .episodes import STATUSES, EpisodeIndex
from .files import EventTail, LineTail

# What one refresh reads of the event log at most (bytes), unless told: a page's requests
# are answered between slices of a long log.
SLICE_BYTES = 1024 * 1024
# ... of metrics.jsonl, this many times that: its rows are the first thing a page shows
# (every agent's curves), and a long run's file is a small part of what it wrote.
METRICS_SLICES = 8


class RunWatch:
    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.epoch = 0
        self._config_text = ""
        self._config_mtime = 0.0
        self.config: dict[str, Any] = {}
        self._start_over()

    def _start_over(self) -> None:
        self._events = EventTail(self.run_dir / "events.log")
        self._metrics = LineTail(self.run_dir / "metrics.jsonl")
        self._samples = LineTail(self.run_dir / "samples.jsonl")
        self.curves = AgentCurves()
        self.cluster = ClusterView()
        self.episodes = EpisodeIndex(self._samples.read_at, self._std_normalized)
        self.run: RunStarted | None = None
        self.events_read = 0
        self.caught_up = False  # the whole log as it stood was read at least once

    # ------------------------------------------------------------ reading

    def refresh(self, max_bytes: int = SLICE_BYTES) -> bool:
        """Reads what was written since the last call (of each file, at most about
        `max_bytes`); returns whether there is more to read now."""
        replaced, events = self._events.poll(max_bytes)
        if replaced:  # a new run in this directory: everything read is another run's
            self.epoch += 1
            self._start_over()
            replaced, events = self._events.poll(max_bytes)
        if self.run is None:
            self.run = next((e for e in events if type(e) is RunStarted), None)
        self._read_config()
        self.cluster.read(events)
        self.episodes.read(events)
        self.events_read += len(events)
        replaced, rows = self._metrics.poll(METRICS_SLICES * max_bytes)
        if replaced:
            self.epoch += 1
            self.curves = AgentCurves()
        for _, row in rows:
            self.curves.add(row)
        replaced, rows = self._samples.poll(max_bytes)
        if replaced:
            self.episodes.forget_texts()
        for offset, row in rows:
            self.episodes.add_text(offset, row)
        more = self._events.bytes_read < self._events.size() and not self._events.problem and bool(events)
        self.caught_up = self.caught_up or not more
        return more or self._metrics.more or self._samples.more

    def _read_config(self) -> None:
        path = self.run_dir / "config.toml"
        try:
            mtime = path.stat().st_mtime
            if mtime != self._config_mtime:
                self._config_text, self._config_mtime = path.read_text(), mtime
                self.config = tomllib.loads(self._config_text)
        except (OSError, tomllib.TOMLDecodeError):
            if not self.config and self.run is not None:  # the log carries the config too
                self._config_text = self.run.config_toml
                try:
                    self.config = tomllib.loads(self._config_text)
                except tomllib.TOMLDecodeError:
                    pass

    def _std_normalized(self, agent: str) -> bool:
        agent_cfg = self.config.get("agents", {}).get(agent, {})
        return bool(agent_cfg.get("normalize_adv_std", True)) if isinstance(agent_cfg, dict) else True

    # ------------------------------------------------------------ asking

    @property
    def config_text(self) -> str:
        return self._config_text

    def agents(self) -> list[str]:
        """The run's agents: as it started them, else as its config or metrics name them."""
        if self.run is not None:
            return list(self.run.agents)
        configured = self.config.get("agents")
        return list(configured) if isinstance(configured, dict) else list(self.curves.agents)

    def header(self) -> dict[str, Any]:
        run = self.run
        steps = self.config.get("run", {}).get("steps") if isinstance(self.config.get("run"), dict) else None
        cluster = self.cluster
        try:
            written = time.time() - (self.run_dir / "events.log").stat().st_mtime
        except OSError:
            written = None
        start = cluster.t_start or 0.0
        return {"run_dir": str(self.run_dir), "epoch": self.epoch, "agents": self.agents(),
                "mode": run.mode if run else None, "max_staleness": run.max_staleness if run else None,
                "seed": run.seed if run else None, "step": self.curves.last_step(), "steps": steps,
                "finished": cluster.finished, "written_s_ago": None if written is None else round(written, 1),
                "wall_s": round(cluster.last_t - start, 2) if cluster.t_start is not None else 0.0,
                "training_s": round(cluster.training_s, 2), "workers": len(cluster.usage.workers),
                "samples": self.episodes.samples, "episodes": len(self.episodes.episodes),
                "lists": {"statuses": STATUSES, "happenings": HAPPENINGS},
                "log": {"events": self.events_read, "bytes_read": self._events.bytes_read,
                        "bytes": self._events.size(), "caught_up": self.caught_up,
                        "problem": self._events.problem or None,
                        "skipped": self._events.skipped, "bad_metrics_lines": self._metrics.bad_lines}}
