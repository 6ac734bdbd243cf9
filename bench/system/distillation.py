"""On-policy distillation against RL alone: a small student reaching a larger trained
teacher's held-out reward on the digit chain's sorting task (examples/distill).

One invocation:
1. trains the teacher (examples/distill_teacher.toml: a sorter four times the planner's
   size) with RL for --teacher-steps, and reads its held-out reward (the evaluation of its
   final weights, sampled at temperature 1, on examples/distill/eval.jsonl). With
   --teacher DIR, an earlier run's teacher (and its reward, from its metrics) is reused.
   With --eval-queries N the held-out set is larger (the committed queries first, then more
   drawn as training draws its own), and the teacher's reward is measured on it: the mean of
   --teacher-evals evaluations of its unchanged weights. --eval-samples N (N samples of each
   held-out query per evaluation) and --eval-temperature T (0: greedy) change how every
   evaluation is made, the teacher's measured the same way;
2. for each seed, trains the student (the digit chain's planner, `tiny:planner`) from the
   same start in each of --modes: "rl" (its reward alone), "distill" (the same, plus the
   teacher's per-token reverse KL, `agents.student.teacher`) and "only" (the reverse KL
   alone, `teacher_only`), evaluating it every --eval-every steps (1: every step); the frozen
   teacher is placed on its own engine in every mode, so all use the same workers.

--teacher-model picks the teacher's recipe (examples/distill/models.py): they differ in
how clean their warm-up targets are. Before the students, it prints what the reverse KL
tells the untrained student (`advantage_profile`).

It prints a JSON row per run (the student's held-out reward per evaluated step) and then,
per mode and seed, the first evaluated step at which the student's held-out reward reached
the teacher's (null: not within the run), the mean curve over the seeds and the first step
at which the mean curve reached it.

    python bench/system/distillation.py --seeds 0,1,2 --steps 60 --teacher-steps 200 --modes rl,distill,only
    python bench/system/distillation.py --teacher-model clean_teacher --teacher-steps 100 ...
    python bench/system/distillation.py --teacher RUN_DIR --modes ''   # a trained teacher's profile alone
    python bench/system/distillation.py --reward exact ...   # a sparse reward: 1 only when all three are right
    python bench/system/distillation.py --coef 0.1 ...       # the reverse KL at a tenth (teacher_coef)
    python bench/system/distillation.py --kl-cap 1 ...       # each token's KL clipped to [-1, 1] (teacher_kl_cap)
    python bench/system/distillation.py --top-k 18 ...       # the forward KL from the teacher's top 18 next tokens
                                                             # (teacher_top_k; 18: the digit tasks' whole vocabulary)
    python bench/system/distillation.py --student-model weak_student --reward exact ...   # a weaker student
    python bench/system/distillation.py --long --teacher-model long_teacher --student-model long_student ...
    python bench/system/distillation.py --long --eval-queries 256 --teacher RUN ...   # a larger held-out set
    python bench/system/distillation.py ... --eval-every 1 --eval-samples 4 --teacher-evals 4   # finer, less noisy
    python bench/system/distillation.py ... --eval-temperature 0   # greedy evaluation (students and teacher)
    python bench/system/distillation.py --smoke      # 1 seed, 2 steps each, a 2-step teacher
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


WORKFLOW = {"fraction": "episode", "exact": "episode_exact"}
LONG = 5  # --long: the digits of the longer sort (examples/distill/workflow.py: episode_long)


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


def workflow(args: argparse.Namespace, agents: tuple[str, ...]) -> list[str]:
    """The task's overrides: its episode, and with --long the five-digit sort's."""
    held_out = f'data.eval="{eval_file(args)}"'
    if not args.long:
        return [f'run.workflow="{EXAMPLES / "distill" / "workflow.py"}:{WORKFLOW[args.reward]}"', held_out]
    if args.reward != "fraction":
        raise SystemExit("--long takes the fraction reward only")
    return [f'run.workflow="{EXAMPLES / "distill" / "workflow.py"}:episode_long"', held_out,
            *(f"agents.{a}.max_tokens={LONG}" for a in agents)]


def eval_file(args: argparse.Namespace) -> Path:
    """The held-out queries: the committed file, or with --eval-queries the larger set
    `held_out_queries` wrote into the work directory."""
    return args.eval_path or EXAMPLES / "distill" / ("eval_long.jsonl" if args.long else "eval.jsonl")


def held_out_queries(committed: Path, n: int, digits: int) -> list[dict]:
    """`n` held-out queries: the committed file's rows first, then more drawn as a training
    episode draws its query (each digit uniform: `make_query` for three, examples/distill/
    workflow.py for five) from a fixed seed, none repeating an earlier row."""
    import random

    rows = [json.loads(line) for line in committed.read_text().splitlines()][:n]
    seen = {tuple(r["digits"]) for r in rows}
    rng = random.Random(f"held-out-{digits}")
    while len(rows) < n:
        query = [rng.randrange(10) for _ in range(digits)]
        if tuple(query) not in seen:
            seen.add(tuple(query))
            rows.append({"digits": query})
    return rows


def evaluation(args: argparse.Namespace) -> list[str]:
    """How every evaluation is made, the teacher's and the students' alike: `args.episodes`
    episodes (the held-out queries in file order, cycled: --eval-samples of each, every one
    with a sampling seed of its own) at --eval-temperature."""
    return [f"eval.episodes={args.episodes}", f"eval.temperature={args.eval_temperature}"]


def first_at(curve: dict[int, float], target: float) -> int | None:
    """The first evaluated step at which `curve` reached `target`; None: never."""
    return next((t for t, r in sorted(curve.items()) if r >= target), None)


def held_out(rows: list[dict], agent: str) -> dict[int, float]:
    return {r["step"]: r["reward_mean"] for r in rows if r.get("kind") == "eval" and r["agent"] == agent}


def teacher(args: argparse.Namespace, work: Path) -> tuple[Path, float]:
    """The trained teacher's checkpoint directory and its held-out reward."""
    run_dir = Path(args.teacher) if args.teacher else work / "teacher"
    if not args.teacher:
        train(EXAMPLES / "distill_teacher.toml", run_dir,
              [f'agents.sorter.model="tiny:{EXAMPLES / "distill" / "models.py"}:{args.teacher_model}"',
               f"run.steps={args.teacher_steps}", f"eval.every={args.teacher_steps}", *evaluation(args),
               f"pipeline.queries_per_step={args.queries}", *workflow(args, ("sorter",))])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = held_out(rows, "sorter")
    checkpoint = (run_dir / "checkpoints" / "final" / "sorter").resolve()
    if not (args.eval_path or args.eval_samples > 1 or args.eval_temperature != 1.0 or args.teacher_evals > 1):
        return checkpoint, rewards[max(rewards)]
    return checkpoint, teacher_on_held_out(args, work, checkpoint)


def teacher_on_held_out(args: argparse.Namespace, work: Path, checkpoint: Path) -> float:
    """The trained teacher's held-out reward on the students' held-out set (the --eval-queries
    set, or the committed file), measured as the students' is (`evaluation`): `--teacher-evals`
    evaluations of its weights, unchanged between them (lr 0), with sampling seeds of their
    own; their mean."""
    run_dir = work / "teacher-held-out"
    rows = train(EXAMPLES / "distill_teacher.toml", run_dir,
                 [f'agents.sorter.model="{checkpoint}"', "agents.sorter.lr=0",
                  f"run.steps={max(1, args.teacher_evals - 1)}", "eval.every=1", "eval.at_start=true",
                  *evaluation(args), f"pipeline.queries_per_step={args.queries}",
                  *workflow(args, ("sorter",))])
    rewards = [r for t, r in sorted(held_out(rows, "sorter").items())][:args.teacher_evals]
    print(json.dumps({"teacher_on_held_out": [round(r, 4) for r in rewards], "episodes": args.episodes,
                      "temperature": args.eval_temperature}), flush=True)
    return statistics.mean(rewards)


def student_model(args: argparse.Namespace) -> str:
    """The student's model: the digit chain's planner, or a recipe of examples/distill/models.py."""
    return "tiny:planner" if args.student_model == "planner" else \
        f"tiny:{EXAMPLES / 'distill' / 'models.py'}:{args.student_model}"


def advantage_profile(teacher_dir: Path, student_path: str, queries: Path, samples: int = 8) -> dict:
    """What the reverse KL tells the student at its start: `samples` outputs per held-out
    query drawn from the untrained student (temperature 1, with transformers), and per
    sampled token its advantage -(log p_student - log p_teacher), split by whether the
    token is the right one (its mean, and the share of right tokens pushed up, after a right
    prefix and after a mistake, and of wrong ones pushed down); the teacher's greedy
    accuracy per position besides."""
    import torch
    from transformers import AutoModelForCausalLM

    from flexmarl.controller.run.model_resolution import resolve_model
    from flexmarl.controller.tasks.digit_chain import DIGIT_IDS, expected_plan, planner_prompt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    student, teach = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                      for path in (resolve_model(student_path), teacher_dir))
    right: list[float] = []
    wrong: list[float] = []
    clean_prefix: list[float] = []  # right tokens after a right prefix
    after_mistake: list[float] = []  # right tokens (for the position's reward) after a wrong one
    greedy = []
    with torch.no_grad():
        for line in queries.read_text().splitlines():
            query = [DIGIT_IDS[d] for d in json.loads(line)["digits"]]
            prompt, want = planner_prompt(query), expected_plan(query)
            ids = torch.tensor([prompt] * samples)
            for _ in want:
                ids = torch.cat([ids, torch.multinomial(student(ids).logits[:, -1].float().softmax(-1), 1)], 1)
            n = len(prompt)
            lp_s, lp_t = (torch.log_softmax(m(ids).logits[:, n - 1:-1].float(), -1).gather(-1, ids[:, n:, None])[..., 0]
                          for m in (student, teach))
            for row, adv in zip(ids[:, n:].tolist(), (lp_t - lp_s).tolist()):
                for j, (token, target, a) in enumerate(zip(row, want, adv)):
                    (right if token == target else wrong).append(a)
                    if token == target:
                        (clean_prefix if row[:j] == want[:j] else after_mistake).append(a)
            ids = torch.tensor([prompt])
            for _ in want:
                ids = torch.cat([ids, teach(ids).logits[:, -1:].argmax(-1)], 1)
            greedy += [t == w for t, w in zip(ids[0, len(prompt):].tolist(), want)]
    return {"student_tokens_right": round(len(right) / (len(right) + len(wrong)), 3),
            "advantage_mean_right": round(statistics.mean(right), 3),
            "advantage_mean_wrong": round(statistics.mean(wrong), 3),
            "right_pushed_up": round(sum(a > 0 for a in right) / len(right), 3),
            "wrong_pushed_down": round(sum(a < 0 for a in wrong) / len(wrong), 3),
            "right_pushed_up_after_right_prefix": round(sum(a > 0 for a in clean_prefix) / len(clean_prefix), 3),
            "right_pushed_up_after_a_mistake": round(sum(a > 0 for a in after_mistake) / len(after_mistake), 3),
            "advantage_abs_share_wrong": round(sum(map(abs, wrong)) / (sum(map(abs, right)) + sum(map(abs, wrong))), 3),
            "teacher_greedy_right": round(sum(greedy) / len(greedy), 3)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=30, help="the student's steps per run")
    parser.add_argument("--teacher-steps", type=int, default=30)
    parser.add_argument("--teacher", default="", help="a teacher run directory to reuse")
    parser.add_argument("--teacher-model", default="teacher",
                        choices=("teacher", "strong_teacher", "clean_teacher", "long_teacher"),
                        help="the teacher's recipe in examples/distill/models.py (before its RL)")
    parser.add_argument("--student-model", default="planner", choices=("planner", "weak_student", "long_student"),
                        help="the student: the digit chain's planner, or the weaker one of examples/distill/models.py")
    parser.add_argument("--queries", type=int, default=16, help="episodes per step")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=0,
                        help="held-out episodes per evaluation (0: --eval-samples per held-out query)")
    parser.add_argument("--eval-samples", type=int, default=1,
                        help="samples of each held-out query per evaluation (each with its own sampling seed)")
    parser.add_argument("--eval-temperature", type=float, default=1.0,
                        help="the evaluations' sampling temperature, the teacher's and the students' (0: greedy)")
    parser.add_argument("--eval-queries", type=int, default=0,
                        help="held-out queries (0: the committed file's 64); more are drawn as training's are, "
                             "and the teacher's reward is then measured on them")
    parser.add_argument("--teacher-evals", type=int, default=1,
                        help="evaluations of the teacher's weights averaged for its reward (more than 1: "
                             "measured as the students are, on their held-out set)")
    parser.add_argument("--lr", type=float, default=0.0, help="agents.student.lr (0: examples/distill.toml's)")
    parser.add_argument("--coef", type=float, default=1.0, help="agents.student.teacher_coef")
    parser.add_argument("--kl-cap", type=float, default=0.0, help="agents.student.teacher_kl_cap (0: not clipped)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="agents.student.teacher_top_k: the forward KL from the teacher's top-k next-token "
                             "distribution at each token, added to the loss (0: the sampled token's reverse KL)")
    parser.add_argument("--modes", default="rl,distill",
                        help="the student's runs per seed: rl (reward alone), distill (reward and reverse KL), "
                             "only (reverse KL alone)")
    parser.add_argument("--reward", choices=("fraction", "exact"), default="fraction",
                        help="the task's reward: the fraction of positions right, or 1 only when all are")
    parser.add_argument("--long", action="store_true",
                        help="the five-digit sort (with --teacher-model long_teacher --student-model long_student)")
    parser.add_argument("--out", default="", help="keep the run directories here")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.eval_samples < 1:
        parser.error(f"--eval-samples {args.eval_samples}: at least 1")
    if args.episodes and args.eval_samples > 1:
        parser.error("--episodes and --eval-samples: give one of them")
    if not set(mode for mode in args.modes.split(",") if mode) <= {"rl", "distill", "only"}:
        parser.error(f"--modes {args.modes!r}: each mode is one of rl, distill, only")
    if args.smoke:  # 4 held-out episodes, unless --eval-samples asks for N of each held-out query
        args.seeds, args.steps, args.teacher_steps, args.queries, args.eval_every = "0", 2, 2, 2, 1
        args.episodes = 0 if args.eval_samples > 1 else 4
    return args


def main() -> None:
    args = parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="distill-") as tmp:
        work = Path(args.out) if args.out else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        args.eval_path = None
        if args.eval_queries:
            queries = held_out_queries(eval_file(args), args.eval_queries, LONG if args.long else 3)
            args.eval_path = work / "held_out.jsonl"
            args.eval_path.write_text("".join(json.dumps(q) + "\n" for q in queries))
        args.episodes = args.episodes or args.eval_samples * len(eval_file(args).read_text().splitlines())
        teacher_dir, target = teacher(args, work)
        print(json.dumps({"teacher": str(teacher_dir), "teacher_held_out_reward": round(target, 4),
                          "reverse_kl_at_the_students_start":
                              advantage_profile(teacher_dir, student_model(args), eval_file(args))}),
              flush=True)
        modes = [mode for mode in args.modes.split(",") if mode]
        curves: dict[str, dict[int, dict[int, float]]] = {mode: {} for mode in modes}
        for seed in seeds:
            for mode in modes:
                student = (["agents.student.teacher=''"] if mode == "rl" else
                           [f"agents.student.teacher_coef={args.coef}", f"agents.student.teacher_kl_cap={args.kl_cap}",
                            f"agents.student.teacher_only={str(mode == 'only').lower()}",
                            f"agents.student.teacher_top_k={args.top_k}"])
                start = time.perf_counter()
                rows = train(EXAMPLES / "distill.toml", work / f"{mode}-{seed}",
                             [f"run.steps={args.steps}", f"run.seed={seed}", f"eval.every={args.eval_every}",
                              *evaluation(args), f"pipeline.queries_per_step={args.queries}",
                              f'agents.teacher.model="{teacher_dir}"', f'agents.student.model="{student_model(args)}"',
                              *workflow(args, ("student", "teacher")), *student,
                              *([f"agents.student.lr={args.lr}"] if args.lr else [])])
                curves[mode][seed] = curve = held_out(rows, "student")
                trained = [r for r in rows if r["agent"] == "student" and "kind" not in r]
                kl = [r["teacher_kl"] for r in trained]
                top_kl = [r.get("teacher_top_kl", 0.0) for r in trained]
                print(json.dumps({"mode": mode, "seed": seed, "held_out": {str(k): round(v, 4) for k, v in curve.items()},
                                  "teacher_kl_first_last": [round(kl[0], 4), round(kl[-1], 4)] if kl else None,
                                  "teacher_top_kl_first_last": [round(top_kl[0], 4), round(top_kl[-1], 4)]
                                  if top_kl and args.top_k and mode != "rl" else None,
                                  "seconds": round(time.perf_counter() - start)}),
                      flush=True)
        for mode, per_seed in curves.items():
            if not per_seed:
                continue
            reached = {seed: first_at(c, target) for seed, c in per_seed.items()}
            steps = sorted(set.intersection(*(set(c) for c in per_seed.values())))
            mean = {t: statistics.mean(c[t] for c in per_seed.values()) for t in steps}
            print(json.dumps({"mode": mode, "steps_to_teacher_reward": {str(s): r for s, r in reached.items()},
                              "mean_steps_to_teacher_reward": first_at(mean, target),
                              "mean_held_out": {str(t): round(r, 4) for t, r in mean.items()}}), flush=True)


if __name__ == "__main__":
    main()
