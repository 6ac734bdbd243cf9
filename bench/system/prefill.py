"""What a real job's rollout engines compute for their prompts, and how fast the job trains.

Runs a job (the default one, examples/review_chain.toml, `turns`, or any config) for a few
steps on this host (controller, vLLM rollout workers and a trainer as separate processes),
with `--instances` rollout instances per engine unit, and reads its event log back. `turns`
(defined here) is one agent (the built-in tiny planner model) answering a 40-token prompt
in groups of 4, then taking a second turn on each sample: the shortest job whose prompts
fill a KV-cache block of the CPU engine (32 tokens; the default job's and the review
chain's contexts stay under one, so their engines' prefix caches can hold nothing). Per job:

    samples_s            samples trained per second of training (after set-up)
    prefilled_per_sample prompt tokens the engines computed (not served from their prefix
                         cache) per sample generated, every turn counted
    first_hit_rate       cached / prompt tokens over first turns (ctx.generate, ctx.chat)
    later_hit_rate       cached / prompt tokens over later turns of a conversation
                         (ctx.continue_chat, ctx.continue_ids): the turn's whole context is its
                         prompt, and the earlier turns are in some engine's prefix cache
    replay_ok            `flexmarl replay --check` of the log reconciles and reproduces it

Prompt and cached tokens are the engines' own counts (vLLM's `num_cached_tokens`), as the
controller logs them with each completed request (RequestsCompleted). vLLM runs a request of
n samples as n sequences and reports one count for it: its first sample is counted as having
found nothing cached (a lower bound on the hits, so never a flattering one). vLLM's prefix
cache reuses whole blocks only: `--block-size` sets the engines' KV-cache block (32 tokens,
the least vLLM's CPU backend takes; its default of 128 is longer than these jobs' contexts).

    .venv/bin/python bench/system/prefill.py [--job default|review_chain|PATH] [--instances 2] [--steps 8]
    .venv/bin/python bench/system/prefill.py --smoke   # the default job, 1 step, 1 instance per agent
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from flexmarl.controller import (
    Experiment,  # noqa: E402
    replay,  # noqa: E402
)
from flexmarl.runtime import events as ev  # noqa: E402
from flexmarl.runtime.aio import run_async  # noqa: E402
from flexmarl.runtime.config import load_config  # noqa: E402
from flexmarl.runtime.eventlog import read_events  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
JOBS = {"default": ROOT / "examples" / "default.toml", "review_chain": ROOT / "examples" / "review_chain.toml",
        "turns": None}
TURNS = {"run": {"workflow": f"{Path(__file__).resolve()}:two_turns", "steps": 8},
         "cluster": {"rollout_workers": 1, "trainer_workers": 1},
         "pipeline": {"queries_per_step": 16, "micro_batch": 32},
         "agents": {"writer": {"model": "tiny:planner", "group_size": 4, "max_tokens": 3, "ignore_eos": True}}}


async def two_turns(ctx) -> None:
    """A 40-token prompt (digits after the query marker), 4 samples, then a second turn of
    each after 4 appended ids; the reward is whether the last id is odd."""
    prompt = [1, 14, *(4 + ctx.rng.randrange(10) for _ in range(38))]
    samples = await ctx.generate("writer", prompt)
    await asyncio.gather(*(ctx.continue_ids(s, [15, 4, 5, 16]) for s in samples))
    for s in samples:
        ctx.reward(s, float(s.output_ids[-1] % 2))


def job_config(job: str, instances: int, steps: int, block_size: int, out: Path, extra: list[str]):
    path = JOBS.get(job, Path(job))
    base = load_config(path, defaults=TURNS if job == "turns" else None)
    units = {a.base or name for name, a in base.agents.items()}
    overrides = [f"cluster.rollout_workers={instances * len(units)}", f"run.steps={steps}", "run.checkpoint_every=0",
                 "eval.every=0", "eval.at_start=false", "run.progress=false", f"run.out='{out}'",
                 *(f"agents.{a}.block_size={block_size}" for a, c in base.agents.items() if not c.base),
                 *(f"bases.{b}.block_size={block_size}" for b in base.bases), *extra]
    return load_config(path, overrides, defaults=TURNS if job == "turns" else None)


def tally(events: list[ev.Event]) -> dict[str, float]:
    """Prompt and cached tokens of first and later turns, samples generated."""
    t = {"prompt": 0, "cached": 0, "turn_prompt": 0, "turn_cached": 0, "generated": 0}
    for e in events:
        if isinstance(e, ev.RequestsCompleted):  # the fields events.PROMPT_FIELDS names (a bench of older code reads them too)
            t["prompt"] += e.prompt_tokens
            t["cached"] += e.cached_tokens
            t["turn_prompt"] += e.turn_prompt_tokens
            t["turn_cached"] += e.turn_cached_tokens
        elif isinstance(e, ev.GroupOpened):
            t["generated"] += e.n
    return t


def run_job(job: str, instances: int, steps: int, block_size: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="flx-prefill-") as tmp:
        cfg = job_config(job, instances, steps, block_size, Path(tmp) / "run", extra)

        async def train():
            async with Experiment(cfg) as exp:
                return await exp.train()

        summary = run_async(train)
        t0 = time.perf_counter()
        events, problem = read_events(Path(summary.run_dir) / "events.log")
        s = replay.summarize(events)
        diff = replay.check(events)
        replay_s = time.perf_counter() - t0
        t = tally(events)
    computed = t["prompt"] + t["turn_prompt"] - t["cached"] - t["turn_cached"]
    return {"job": job, "instances_per_unit": instances, "steps": steps, "block_size": block_size,
            "samples": summary.samples, "train_s": round(summary.wall_s, 2),
            "samples_s": round(summary.samples / summary.wall_s, 2) if summary.wall_s else 0.0,
            "prefilled_per_sample": round(computed / t["generated"], 2) if t["generated"] else None,
            "first_hit_rate": round(t["cached"] / t["prompt"], 3) if t["prompt"] else None,
            "later_hit_rate": round(t["turn_cached"] / t["turn_prompt"], 3) if t["turn_prompt"] else None,
            "later_prompt_tokens": t["turn_prompt"], "replay_s": round(replay_s, 2),
            "replay_ok": not problem and not s.errors and diff is None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default="default", help="default, review_chain, turns or a config path")
    parser.add_argument("--instances", type=int, default=2, help="rollout instances per engine unit")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32, help="the engines' KV-cache block, tokens")
    parser.add_argument("--set", action="append", default=[], help="another config override (KEY=VALUE)")
    parser.add_argument("--smoke", action="store_true", help="the default job, one step, one instance per agent")
    args = parser.parse_args()
    if args.smoke:
        args.job, args.instances, args.steps = "default", 1, 1
        args.set += ["pipeline.queries_per_step=2", "pipeline.micro_batch=8"]
    row = run_job(args.job, args.instances, args.steps, args.block_size, args.set)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
