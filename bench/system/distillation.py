"""On-policy distillation against RL alone: a small student reaching a larger trained
teacher's held-out reward on the digit chain's sorting task (examples/distill).

One invocation:
1. trains the teacher (examples/distill_teacher.toml: a sorter four times the planner's
   size) with RL for --teacher-steps, and reads its held-out reward (the evaluation of its
   final weights, sampled at temperature 1, on examples/distill/eval.jsonl). With
   --teacher DIR, an earlier run's teacher (and its reward, from its metrics) is reused;
2. for each seed, trains the student (the digit chain's planner, `tiny:planner`) from the
   same start twice: "rl" (its reward alone) and "distill" (the same, plus the teacher's
   per-token reverse KL, `agents.student.teacher`), evaluating it every --eval-every steps;
   the frozen teacher is placed on its own engine in both modes, so both use the same
   workers. With --only the distilled student learns from the reverse KL alone.

It prints a JSON row per run (the student's held-out reward per evaluated step) and then,
per mode and seed, the first evaluated step at which the student's held-out reward reached
the teacher's (null: not within the run), and the mean curve over the seeds.

    python bench/system/distillation.py --seeds 0,1,2 --steps 30 --teacher-steps 30
    python bench/system/distillation.py --reward exact ...   # a sparse reward: 1 only when all three are right
    python bench/system/distillation.py --smoke      # 1 seed, 2 steps each, a 2-step teacher
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


WORKFLOW = {"fraction": "episode", "exact": "episode_exact"}


def train(toml: Path, run_dir: Path, overrides: list[str]) -> list[dict]:
    """Runs the job in this process; its metrics rows."""
    from flexmarl.controller import Experiment
    from flexmarl.runtime.config import load_config

    cfg = load_config(toml, ["run.progress=false", "run.checkpoint_every=0", f'run.out="{run_dir}"', *overrides])

    async def main():
        async with Experiment(cfg, run_dir=run_dir) as exp:
            await exp.train()

    asyncio.run(main())
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def workflow(args: argparse.Namespace) -> str:
    return f'run.workflow="{EXAMPLES / "distill" / "workflow.py"}:{WORKFLOW[args.reward]}"'


def held_out(rows: list[dict], agent: str) -> dict[int, float]:
    return {r["step"]: r["reward_mean"] for r in rows if r.get("kind") == "eval" and r["agent"] == agent}


def teacher(args: argparse.Namespace, work: Path) -> tuple[Path, float]:
    """The trained teacher's checkpoint directory and its held-out reward."""
    run_dir = Path(args.teacher) if args.teacher else work / "teacher"
    if not args.teacher:
        train(EXAMPLES / "distill_teacher.toml", run_dir,
              [f"run.steps={args.teacher_steps}", f"eval.every={args.teacher_steps}", f"eval.episodes={args.episodes}",
               f"pipeline.queries_per_step={args.queries}", workflow(args)])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = held_out(rows, "sorter")
    return (run_dir / "checkpoints" / "final" / "sorter").resolve(), rewards[max(rewards)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=30, help="the student's steps per run")
    parser.add_argument("--teacher-steps", type=int, default=30)
    parser.add_argument("--teacher", default="", help="a teacher run directory to reuse")
    parser.add_argument("--queries", type=int, default=16, help="episodes per step")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=64, help="held-out episodes per evaluation")
    parser.add_argument("--coef", type=float, default=1.0, help="agents.student.teacher_coef")
    parser.add_argument("--only", action="store_true", help="distil with the reverse KL alone (teacher_only)")
    parser.add_argument("--modes", default="rl,distill", help="which of the student's runs to make")
    parser.add_argument("--reward", choices=("fraction", "exact"), default="fraction",
                        help="the task's reward: the fraction of positions right, or 1 only when all are")
    parser.add_argument("--out", default="", help="keep the run directories here")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.steps, args.teacher_steps, args.queries, args.eval_every, args.episodes = "0", 2, 2, 2, 1, 4
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="distill-") as tmp:
        work = Path(args.out) if args.out else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        teacher_dir, target = teacher(args, work)
        print(json.dumps({"teacher": str(teacher_dir), "teacher_held_out_reward": round(target, 4)}), flush=True)
        modes = args.modes.split(",")
        curves: dict[str, dict[int, dict[int, float]]] = {mode: {} for mode in modes}
        for seed in seeds:
            for mode in modes:
                student = (["agents.student.teacher=''"] if mode == "rl" else
                           [f"agents.student.teacher_coef={args.coef}", f"agents.student.teacher_only={str(args.only).lower()}"])
                rows = train(EXAMPLES / "distill.toml", work / f"{mode}-{seed}",
                             [f"run.steps={args.steps}", f"run.seed={seed}", f"eval.every={args.eval_every}",
                              f"eval.episodes={args.episodes}", f"pipeline.queries_per_step={args.queries}",
                              f'agents.teacher.model="{teacher_dir}"', workflow(args), *student])
                curves[mode][seed] = curve = held_out(rows, "student")
                kl = [r["teacher_kl"] for r in rows if r["agent"] == "student" and "kind" not in r]
                print(json.dumps({"mode": mode, "seed": seed, "held_out": {str(k): round(v, 4) for k, v in curve.items()},
                                  "teacher_kl_first_last": [round(kl[0], 4), round(kl[-1], 4)] if kl else None}),
                      flush=True)
        for mode, per_seed in curves.items():
            reached = {seed: next((t for t, r in sorted(c.items()) if r >= target), None) for seed, c in per_seed.items()}
            steps = sorted(set.intersection(*(set(c) for c in per_seed.values())))
            mean = {str(t): round(statistics.mean(c[t] for c in per_seed.values()), 4) for t in steps}
            print(json.dumps({"mode": mode, "steps_to_teacher_reward": {str(s): r for s, r in reached.items()},
                              "mean_held_out": mean}), flush=True)


if __name__ == "__main__":
    main()
