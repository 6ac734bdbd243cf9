"""The signals a researcher reads to trust a run, on the default job.

Runs the default job once per setting (same seed, same steps), one after the other, and
prints per agent the first and last steps' reward and the trainer's step statistics from
metrics.jsonl: entropy, gradient norm, the sampler-vs-trainer logprob mismatch (mean
absolute difference and the k3 KL estimate) and the fraction of clipped importance
weights, plus the trained samples' staleness. It also draws the curves (reward, entropy,
mismatch, grad norm per step) to --plot.

Settings: sync, async K=1 (both at temperature 1), and sync at temperature 0.7. At any
temperature the trainer scores tokens under logits / temperature, so the mismatch is
numerical noise between two implementations (vLLM and torch), not a different policy.

    .venv/bin/python bench/signals.py [--steps 40] [--plot bench/signals.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from flexmarl.controller import Experiment
from flexmarl.controller.digit_chain import AGENTS, default_config
from flexmarl.runtime.aio import limit_threads, setup_logging
from flexmarl.runtime.config import load_config

SETTINGS = {
    "sync T=1": ["pipeline.mode='sync'"],
    "async K=1 T=1": ["pipeline.mode='async'", "pipeline.max_staleness=1"],
    "sync T=0.7": ["pipeline.mode='sync'", *(f"agents.{a}.temperature=0.7" for a in AGENTS)],
}
COLUMNS = ("reward_mean", "entropy", "grad_norm", "logprob_abs_diff", "rollout_kl", "clip_frac",
           "staleness_mean", "staleness_max", "response_len_mean")


def run(name: str, overrides: list[str], args: argparse.Namespace) -> list[dict]:
    cfg = load_config(None, [f"run.steps={args.steps}", f"run.seed={args.seed}", "run.progress=false", *overrides],
                      defaults=default_config())
    with tempfile.TemporaryDirectory() as run_dir:
        async def main():
            async with Experiment(cfg, run_dir=run_dir) as exp:
                return await exp.train()

        asyncio.run(main())
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict], agent: str, window: int = 5) -> dict:
    mine = [r for r in rows if r["agent"] == agent and "kind" not in r]
    head, tail = mine[:window], mine[-window:]
    mean = lambda rs, k: round(statistics.mean(r[k] for r in rs if r.get(k) is not None), 4)  # noqa: E731
    return {"agent": agent, **{f"first_{k}": mean(head, k) for k in ("reward_mean", "entropy")},
            **{f"last_{k}": mean(tail, k) for k in COLUMNS},
            "mean_logprob_abs_diff": mean(mine, "logprob_abs_diff"), "mean_rollout_kl": mean(mine, "rollout_kl")}


def plot(results: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("reward_mean", "entropy", "logprob_abs_diff", "grad_norm")
    fig, axes = plt.subplots(len(keys), len(results), figsize=(4 * len(results), 2.6 * len(keys)), squeeze=False)
    for col, (name, rows) in enumerate(results.items()):
        for row, key in enumerate(keys):
            ax = axes[row][col]
            for agent in AGENTS:
                pts = [(r["step"], r[key]) for r in rows if r["agent"] == agent and "kind" not in r]
                ax.plot(*zip(*pts), label=agent)
            ax.set_title(f"{name}: {key}", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    limit_threads(1)
    setup_logging("WARNING")
    results = {}
    for name in args.settings.split(","):
        results[name] = run(name, SETTINGS[name], args)
        for agent in AGENTS:
            print(json.dumps({"setting": name, **summary(results[name], agent)}), flush=True)
    if args.plot:
        plot(results, args.plot)
        print(f"curves written to {args.plot}")


if __name__ == "__main__":
    main()
