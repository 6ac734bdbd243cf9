"""Adapter agents' learning rate: one job trained at several rates, each agent's reward at
the start and the end.

For each rate in --lrs the job (a TOML of adapter agents: examples/digit_team.toml by
default) runs through `flexmarl run` (real processes) with every adapter agent's `lr` set
to it (`--set` for any other change). From each run's metrics.jsonl it reports, per agent,
as a JSON row and in a table:

- train_start / train_end: the mean training reward of the first and of the last
  --window steps;
- eval_start / eval_end: the held-out reward (`"kind": "eval"` rows) of the first and
  the last evaluation, where the job evaluates (`[eval]` with `at_start = true` gives
  the start: the base alone);
- rises: eval_end > eval_start where there are evaluations, else train_end > train_start.

    python bench/system/adapter_lr.py --lrs 0.002,0.005,0.01,0.02 --steps 80
    python bench/system/adapter_lr.py examples/review_team.toml --lrs 0.002,0.01 --steps 40
    python bench/system/adapter_lr.py --smoke        # digit team, two rates, two steps each
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def adapter_agents(config: Path) -> list[str]:
    from flexmarl.runtime.config import load_config

    cfg = load_config(config)
    return [name for name, agent in cfg.agents.items() if agent.base]


def run_at(config: Path, lr: float, steps: int, extra: list[str], run_dir: Path) -> None:
    sets = [f"agents.{a}.lr={lr}" for a in adapter_agents(config)] + extra
    command = [sys.executable, "-m", "flexmarl.controller.cli", "run", str(config), "--steps", str(steps),
               "--out", str(run_dir), "--no-progress", *(arg for s in sets for arg in ("--set", s))]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the run at lr {lr} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def rewards(run_dir: Path, window: int) -> dict[str, dict]:
    """Per agent: the training reward of the first and last `window` steps, and the first
    and last held-out evaluation."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    found = {}
    for agent in dict.fromkeys(r["agent"] for r in rows):
        train = [r["reward_mean"] for r in rows if r["agent"] == agent and "kind" not in r
                 and r["reward_mean"] is not None]
        evals = [(r["step"], r["reward_mean"]) for r in rows if r["agent"] == agent and r.get("kind") == "eval"]
        start, end = mean(train[:window]), mean(train[-window:])
        row = {"agent": agent, "train_start": start, "train_end": end}
        if evals:
            row |= {"eval_start_step": evals[0][0], "eval_start": round(evals[0][1], 4),
                    "eval_end_step": evals[-1][0], "eval_end": round(evals[-1][1], 4)}
            row["rises"] = evals[-1][1] > evals[0][1]
        else:
            row["rises"] = start is not None and end is not None and end > start
        found[agent] = row
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "examples" / "digit_team.toml"))
    parser.add_argument("--lrs", default="0.002,0.005,0.01,0.02", help="learning rates, comma-separated")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="another override, key=value")
    parser.add_argument("--out", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="two rates, two steps, a window of one")
    args = parser.parse_args()
    lrs = [0.002, 0.02] if args.smoke else [float(x) for x in args.lrs.split(",")]
    steps, window = (2, 1) if args.smoke else (args.steps, args.window)
    config = Path(args.config).resolve()
    table = []
    with tempfile.TemporaryDirectory(prefix="adapter_lr-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        for lr in lrs:
            started = time.monotonic()
            run_at(config, lr, steps, args.sets, out / f"lr-{lr:g}")
            wall = round(time.monotonic() - started, 1)
            for row in rewards(out / f"lr-{lr:g}", window).values():
                row = {"lr": lr, "steps": steps, **row, "wall_s": wall}
                print(json.dumps(row), flush=True)
                table.append(row)
    print(f"\n| lr | agent | train (first {window} steps -> last {window}) | held-out (first -> last evaluation) |")
    print("|---|---|---|---|")
    for r in table:
        held = (f"{r['eval_start']} (step {r['eval_start_step']}) -> {r['eval_end']} (step {r['eval_end_step']})"
                if "eval_start" in r else "-")
        print(f"| {r['lr']:g} | {r['agent']} | {r['train_start']} -> {r['train_end']} | {held} |")


if __name__ == "__main__":
    main()
