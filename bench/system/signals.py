"""The signals a researcher reads to trust a run, on the default job.

Two parts in one invocation.

1. The on-policy mismatch (skipped with --no-mismatch). For each agent's model of the
   default job, vLLM samples digit-chain prompts at each (temperature, top_p, top_k) of
   --mismatch-settings, and the trainer's code scores the same tokens on the same weights
   two ways:
   - "before": log_softmax(logits / T), the plain temperature-scaled softmax, which is how
     the trainer scored every token before it knew top_k and top_p;
   - "after": `workers.sampling.sampler_log_probs`, the trainer's scoring now: the
     distribution the sampler drew from (temperature, top_k, top_p, renormalised).
   Nothing is stale, so any difference is the scoring's. Per setting and scoring: the mean
   |trainer - sampler| logprob, the k3 KL estimate, the mean and smallest ratio pi/mu, and
   the fraction of tokens each correction of workers/trainer/loss.py (OFF_POLICY, at its default
   constants) would clip or mask on that batch, advantages +1 and -1 in turn.

2. The default job once per setting of --settings (same seed, same steps), one after the
   other: per agent the first and last steps' reward and the trainer's step statistics
   from metrics.jsonl: entropy, gradient norm, the sampler-vs-trainer logprob mismatch
   (mean absolute difference and the k3 KL estimate), the fraction of tokens the
   correction clipped or masked, and the trained samples' staleness. Settings: sync, async
   K=1 (both at temperature 1) and sync at temperature 0.7 ("default"); and async K=2 with
   each off-policy correction ("k2": `flexmarl run --mode async --max-staleness 2` with
   agents.*.off_policy set). It also draws the curves (reward, entropy, mismatch, grad norm
   per step) to --plot.

Each part prints one JSON row per result as it comes, then a markdown table.

    .venv/bin/python bench/system/signals.py [--steps 40] [--settings default|k2|NAME,...] [--plot bench/system/signals.png]
    .venv/bin/python bench/system/signals.py --smoke   # both parts at tiny sizes (about a minute on a quiet machine)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the mismatch part's engine, in-process

from flexmarl.controller import Experiment  # noqa: E402
from flexmarl.controller.tasks import digit_chain as dc  # noqa: E402
from flexmarl.controller.tasks.digit_chain import AGENTS, default_config  # noqa: E402
from flexmarl.runtime.aio import limit_threads, setup_logging  # noqa: E402
from flexmarl.runtime.config import load_config  # noqa: E402
from flexmarl.workers.trainer.loss import OFF_POLICY  # noqa: E402

CORRECTIONS = tuple(OFF_POLICY)
SETTINGS = {
    "sync T=1": ["pipeline.mode='sync'"],
    "async K=1 T=1": ["pipeline.mode='async'", "pipeline.max_staleness=1"],
    "sync T=0.7": ["pipeline.mode='sync'", *(f"agents.{a}.temperature=0.7" for a in AGENTS)],
    **{f"async K=2 {c}": ["pipeline.mode='async'", "pipeline.max_staleness=2",
                          *(f"agents.{a}.off_policy='{c}'" for a in AGENTS)] for c in CORRECTIONS},
}
GROUPS = {"default": ["sync T=1", "async K=1 T=1", "sync T=0.7"],
          "k2": [f"async K=2 {c}" for c in CORRECTIONS]}
COLUMNS = ("reward_mean", "entropy", "grad_norm", "logprob_abs_diff", "rollout_kl", "clip_frac",
           "staleness_mean", "staleness_max", "response_len_mean")
# (temperature, top_p, top_k): plain temperatures, then top_p and top_k cuts, then both.
MISMATCH_SETTINGS = "1,1,0;0.7,1,0;1,0.5,0;0.8,0.7,0;0.8,1,5;0.7,1,3;0.8,0.9,5"


# ---------------------------------------------------------------- part 1: on-policy mismatch


def prompts_for(agent: str, rng: random.Random, n: int) -> list[list[int]]:
    """n prompts of the agent's kind, each agent reading the right output of the one before."""
    out = []
    for _ in range(n):
        query = dc.make_query(rng)
        plan = dc.expected_plan(query)
        answer = dc.expected_answer(plan)
        out.append({dc.PLANNER: dc.planner_prompt(query), dc.SOLVER: dc.solver_prompt(plan),
                    dc.CHECKER: dc.checker_prompt(plan, answer)}[agent])
    return out


def draw(engine, prompts: list[list[int]], max_tokens: int, setting: tuple[float, float, int], seed: int) -> list:
    """What the engine wrote at `setting`, with its logprobs, as the trainer reads it (each
    sample a group of its own); advantages +1, -1 in turn."""
    from flexmarl.runtime.keys import GroupKey
    from flexmarl.workers.trainer.batch import samples_of, train_group

    temperature, top_p, top_k = setting
    for i, prompt in enumerate(prompts):
        engine.add(str(i), prompt, max_tokens, temperature, seed + i, top_p=top_p, top_k=top_k, ignore_eos=True)
    done = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    return samples_of([train_group(GroupKey("bench", "agent", str(i)), prompt, [done[str(i)].token_ids],
                                   [1.0 if i % 2 else -1.0], [done[str(i)].logprobs], temperature=temperature,
                                   top_p=top_p, top_k=top_k) for i, prompt in enumerate(prompts)])


def mismatch_sums(model, samples: list, clip_ratio: float) -> dict[str, dict[str, float]]:
    """Per scoring ("before", "after"): token count, sums of |d|, k3(d) and pi/mu, the
    smallest pi/mu, and per correction the count of tokens it flags; d = trainer - sampler."""
    import torch

    from flexmarl.runtime import protocol as p
    from flexmarl.workers.trainer.loss import Tokens, k3
    from flexmarl.workers.trainer.sampling import turn_settings
    from flexmarl.workers.trainer.scoring import token_scores

    width = max(len(s.output_ids) for s in samples)
    valid = torch.tensor([[j < len(s.output_ids) for j in range(width)] for s in samples])
    with torch.no_grad():
        temperature, top_k, top_p = turn_settings(samples, width)
        uncut = (temperature, torch.zeros_like(top_k), torch.ones_like(top_p))
        scorings = {"before": token_scores(model, samples, valid, *uncut)[0],
                    "after": token_scores(model, samples, valid, temperature, top_k, top_p)[0]}
        rollout = torch.tensor([list(s.rollout_logprobs) for s in samples])
        adv = torch.tensor([[s.advantage] for s in samples])
        out = {}
        for name, logp in scorings.items():
            d = (logp - rollout)[valid]
            row = {"tokens": float(valid.sum()), "abs_diff": float(d.abs().sum()), "k3": float(k3(d).sum()),
                   "ratio": float(d.exp().sum()), "ratio_min": float(d.exp().min())}
            tokens = Tokens(logp, rollout, adv, valid.float())
            for correction in CORRECTIONS:
                flagged = OFF_POLICY[correction](tokens, p.LossOptions(off_policy=correction), clip_ratio)[1]
                row[correction] = float((flagged & valid).sum())
            out[name] = row
    return out


def mismatch(args: argparse.Namespace) -> list[dict]:
    """Part 1: one row per (setting, scoring, agent), and per (setting, scoring) over all agents."""
    import torch
    from transformers import AutoModelForCausalLM

    from flexmarl.controller.run.model_resolution import resolve_model
    from flexmarl.runtime import protocol as p
    from flexmarl.runtime.config import PipelineConfig
    from flexmarl.workers.rollout.engine import VllmEngine

    settings = [(float(t), float(tp), int(tk)) for t, tp, tk in
                (s.split(",") for s in args.mismatch_settings.split(";"))]
    clip_ratio = PipelineConfig().clip_ratio
    pooled: dict[tuple, dict[str, float]] = {}
    rows = []
    for agent in args.mismatch_agents.split(","):
        model_dir = resolve_model(f"tiny:{agent}")
        engine = VllmEngine(model_dir, seed=args.seed, settings=p.EngineSettings())
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompts = prompts_for(agent, random.Random(f"{args.seed}-{agent}"), args.mismatch_prompts)
        try:
            for i, setting in enumerate(settings):
                samples = draw(engine, prompts, dc.OUTPUT_LEN[agent], setting, seed=1000 * i)
                for scoring, sums in mismatch_sums(model, samples, clip_ratio).items():
                    rows.append(mismatch_row(agent, setting, scoring, sums))
                    print(json.dumps(rows[-1]), flush=True)
                    total = pooled.setdefault((setting, scoring), {"ratio_min": float("inf")})
                    for key, value in sums.items():
                        total[key] = min(total[key], value) if key == "ratio_min" else total.get(key, 0.0) + value
        finally:
            engine.close()
    all_rows = [mismatch_row("all", setting, scoring, sums) for (setting, scoring), sums in pooled.items()]
    for row in all_rows:
        print(json.dumps(row), flush=True)
    print_mismatch_table(all_rows)
    return rows + all_rows


def mismatch_row(agent: str, setting: tuple[float, float, int], scoring: str, sums: dict[str, float]) -> dict:
    n = sums["tokens"]
    return {"part": "mismatch", "agent": agent, "temperature": setting[0], "top_p": setting[1], "top_k": setting[2],
            "scoring": scoring, "tokens": int(n), "logprob_abs_diff": sums["abs_diff"] / n,
            "rollout_kl": sums["k3"] / n, "ratio_mean": round(sums["ratio"] / n, 4),
            "ratio_min": round(sums["ratio_min"], 4),
            "flagged": {c: round(sums[c] / n, 4) for c in CORRECTIONS}}


def small(x: float) -> str:
    """A mismatch figure: four decimals, or two significant digits below 1e-3 (0 stays 0)."""
    return f"{x:.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def print_mismatch_table(rows: list[dict]) -> None:
    print("\n| T | top_p | top_k | trainer scoring | mean abs logprob diff | k3 KL | mean pi/mu | min pi/mu | "
          + " | ".join(f"{c} flagged" for c in CORRECTIONS) + " |")
    print("|" + "---|" * (8 + len(CORRECTIONS)))
    for r in rows:
        label = "after: sampler's distribution" if r["scoring"] == "after" else "before: log_softmax(logits / T)"
        print(f"| {r['temperature']} | {r['top_p']} | {r['top_k']} | {label} | {small(r['logprob_abs_diff'])} | "
              f"{small(r['rollout_kl'])} | {r['ratio_mean']:.3f} | {r['ratio_min']:.3f} | "
              + " | ".join(f"{100 * r['flagged'][c]:.1f}%" for c in CORRECTIONS) + " |", flush=True)


# ---------------------------------------------------------------- part 2: the default job per setting


def run(overrides: list[str], args: argparse.Namespace) -> tuple[list[dict], float]:
    """(metrics.jsonl rows, wall seconds) of one run of the default job."""
    cfg = load_config(None, [f"run.steps={args.steps}", f"run.seed={args.seed}", "run.progress=false",
                             *args.set, *overrides], defaults=default_config())
    with tempfile.TemporaryDirectory() as run_dir:
        async def main():
            async with Experiment(cfg, run_dir=run_dir) as exp:
                return await exp.train()

        start = time.perf_counter()
        asyncio.run(main())
        seconds = time.perf_counter() - start
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()], seconds


def summary(rows: list[dict], agent: str, window: int = 5) -> dict:
    mine = [r for r in rows if r["agent"] == agent and "kind" not in r]
    head, tail = mine[:window], mine[-window:]

    def mean(rs, k):
        values = [r[k] for r in rs if r.get(k) is not None]
        return round(statistics.mean(values), 6) if values else None

    return {"agent": agent, **{f"first_{k}": mean(head, k) for k in ("reward_mean", "entropy")},
            **{f"last_{k}": mean(tail, k) for k in COLUMNS},
            **{f"mean_{k}": mean(mine, k) for k in ("logprob_abs_diff", "rollout_kl", "clip_frac", "staleness_mean")},
            "skipped_steps": sum(1 for r in mine if r.get("skipped"))}


def print_runs_table(rows: list[dict]) -> None:
    print("\n| setting | agent | reward first -> last | entropy first -> last | mean abs logprob diff | "
          "mean k3 KL | clipped or masked | staleness mean | run s |")
    print("|" + "---|" * 9)
    for r in rows:
        print(f"| {r['setting']} | {r['agent']} | {r['first_reward_mean']:.3f} -> {r['last_reward_mean']:.3f} | "
              f"{r['first_entropy']:.2f} -> {r['last_entropy']:.2f} | {small(r['mean_logprob_abs_diff'])} | "
              f"{small(r['mean_rollout_kl'])} | {100 * (r['mean_clip_frac'] or 0):.2f}% | "
              f"{r['mean_staleness_mean'] or 0:.2f} | {r['seconds']:.0f} |", flush=True)


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


def runs(args: argparse.Namespace) -> list[dict]:
    """Part 2: one row per (setting, agent), then the table and the curves."""
    names = [n for item in args.settings.split(",") if item for n in GROUPS.get(item, [item])]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {sorted(SETTINGS)} or groups {sorted(GROUPS)}")
    results, out = {}, []
    for name in names:
        results[name], seconds = run(SETTINGS[name], args)
        for agent in AGENTS:
            out.append({"part": "run", "setting": name, **summary(results[name], agent), "seconds": round(seconds, 1)})
            print(json.dumps(out[-1]), flush=True)
    print_runs_table(out)
    if args.plot:
        plot(results, args.plot)
        print(f"curves written to {args.plot}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", default="default", help="setting names or groups (default, k2), comma-separated; "
                        "empty: no runs")
    parser.add_argument("--set", action="append", default=[], help="a config override for every run (KEY=VALUE)")
    parser.add_argument("--plot", default="")
    parser.add_argument("--no-mismatch", action="store_true", help="skip part 1")
    parser.add_argument("--mismatch-settings", default=MISMATCH_SETTINGS, help="T,top_p,top_k;...")
    parser.add_argument("--mismatch-agents", default=",".join(AGENTS))
    parser.add_argument("--mismatch-prompts", type=int, default=64, help="samples per agent and setting")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: both parts in about a minute")
    args = parser.parse_args()
    if args.smoke:
        args.mismatch_settings, args.mismatch_agents, args.mismatch_prompts = "0.8,0.7,0;0.8,1,5", dc.PLANNER, 4
        args.settings, args.steps, args.plot = "async K=2 ppo_clip", 2, ""
        args.set = ["pipeline.queries_per_step=2", *args.set]
    limit_threads(1)
    setup_logging("WARNING")
    if not args.no_mismatch:
        mismatch(args)
    if args.settings:
        runs(args)


if __name__ == "__main__":
    main()
