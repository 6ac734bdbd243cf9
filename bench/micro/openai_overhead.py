"""The OpenAI endpoint's cost against `ctx.chat`, on the same job, in one invocation.

1. The job: the review chain trained for --job-steps steps written both ways, its
   episodes by `ctx.chat` (examples/review_chain.toml) and as OpenAI client code through
   the endpoint (examples/openai_team.toml: the same models, data, rewards and settings),
   one after the other in this process. Reported: trained samples/s after set-up (the
   run's own figure) and the ratio (target: the endpoint's at least 1 / 1.2 of chat's).

2. The calls alone, where nothing else hides them: starts one job (real processes: a vLLM rollout worker on the review chain's verifier
model, a trainer the bench never uses), sets it up, starts its endpoint, then runs the
same episodes both ways, in alternating rounds so drift in the machine's load falls on
both alike:

- chat: `ctx.chat(agent, question)` (a group of group_size), then every sample continued
  once (`ctx.continue_chat`), rewards;
- endpoint: the same through `ctx.openai_client()`: one call without `n` (the group),
  then one call per choice whose messages extend its conversation (the continuation);
- http: the same through a client of the episode's own pointed at `ctx.openai_base_url`
  (loopback TCP, uvicorn, Starlette), as `ctx.openai_client()` was before it went around
  the socket.

Each round runs --episodes episodes at once (as a step's queries do). Reported, per way:
samples/s (wall) and the controller's CPU per call (this process's CPU time over calls;
the engine runs in its own process; the agent code's `openai` client runs in this
process too, as it does in a job), then the endpoint's samples/s over chat's and its
extra CPU per call.

    python bench/micro/openai_overhead.py --job-steps 10 --rounds 6 --episodes 8
    python bench/micro/openai_overhead.py --smoke      # one step of each job, one round of two episodes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CRITIC = f"tiny:{ROOT / 'examples' / 'review_chain' / 'models.py'}:verifier"
QUESTION = [{"role": "user", "content": "Question: What is 2 + 3? Answer: 5"}]
FOLLOW = {"role": "user", "content": "It is 5, correct."}


async def by_chat(ctx) -> int:
    samples = await ctx.chat("critic", QUESTION)
    await asyncio.gather(*(ctx.continue_chat(s, [FOLLOW]) for s in samples))
    ctx.reward_all("critic", lambda s: float("correct" in s.text))
    return 1 + len(samples)


async def by_endpoint(ctx, client=None) -> int:
    client = client or ctx.openai_client()
    first = await client.chat.completions.create(model="critic", messages=QUESTION)

    async def go_on(choice) -> None:
        said = {"role": "assistant", "content": choice.message.content}
        await client.chat.completions.create(model="critic", messages=QUESTION + [said, FOLLOW])

    await asyncio.gather(*(go_on(c) for c in first.choices))
    ctx.reward_all("critic", lambda s: float("correct" in s.text))
    return 1 + len(first.choices)


async def by_http(ctx) -> int:
    """The endpoint through a client of the episode's own over HTTP (loopback TCP,
    uvicorn, Starlette): what `ctx.openai_client()` did before it went around the socket."""
    import openai

    from flexmarl.controller.serving.openai_api import OpenAIEndpoint

    http = openai.DefaultAsyncHttpxClient(verify=False, event_hooks={"request": [OpenAIEndpoint.mark_branch]})
    client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.openai_api_key, http_client=http,
                                max_retries=0)
    try:
        return await by_endpoint(ctx, client)
    finally:
        await client.close()


WAYS = {"chat": by_chat, "endpoint": by_endpoint, "http": by_http}


async def one_round(training, way: str, round_no: int, episodes: int) -> tuple[int, int, float, float]:
    """(calls, samples, wall seconds, CPU seconds) of `episodes` episodes run at once."""
    from flexmarl.controller.episodes.workflow import run_episode
    from flexmarl.controller.state.store import ExperienceStore

    store = ExperienceStore(["critic"])
    calls = []

    async def episode(ctx) -> None:
        calls.append(await WAYS[way](ctx))

    contexts = [training.parts.episodes.contexts.make(f"{way}{round_no}q{i}", 1, random.Random(i), store, None)
                for i in range(episodes)]
    wall, cpu = time.perf_counter(), time.process_time()
    failures = await asyncio.gather(*(run_episode(episode, ctx, 300) for ctx in contexts))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if any(failures):
        raise RuntimeError(f"an episode failed: {[f for f in failures if f][0]}")
    return sum(calls), store.count("critic", "generated"), wall, cpu


async def train_job(toml: str, steps: int) -> dict:
    from flexmarl.controller.run.experiment import Experiment
    from flexmarl.runtime.config import load_config

    cfg = load_config(ROOT / "examples" / toml, [f"run.steps={steps}", "eval.every=0", "run.progress=false",
                                                   "run.checkpoint_every=0"])
    with tempfile.TemporaryDirectory() as run_dir:
        async with Experiment(cfg, run_dir=run_dir) as exp:
            summary = await exp.train()
    return {"job": toml, "steps": steps, "samples": summary.samples, "wall_s": round(summary.wall_s, 2),
            "samples_per_s": round(summary.samples / summary.wall_s, 2), "episodes_failed": summary.episodes_failed}


async def measure_jobs(steps: int) -> list[dict]:
    rows = [await train_job("review_chain.toml", steps), await train_job("openai_team.toml", steps)]
    rows.append({"job": "openai_team/review_chain",
                 "samples_per_s_ratio": round(rows[1]["samples_per_s"] / rows[0]["samples_per_s"], 3)})
    return rows


async def measure(rounds: int, episodes: int, group_size: int) -> list[dict]:
    from flexmarl.controller.run.experiment import Experiment
    from flexmarl.runtime.config import load_config

    overrides = ["run.workflow=" + str(Path(__file__).resolve()) + ":by_chat", "run.progress=false",
                 "cluster.rollout_workers=1", "cluster.trainer_workers=1", "openai.enabled=true",
                 "run.event_log=false", f"agents.critic.model={CRITIC}", f"agents.critic.group_size={group_size}",
                 "agents.critic.max_tokens=10"]
    cfg = load_config(overrides=overrides)
    totals = {way: [0, 0, 0.0, 0.0] for way in WAYS}
    with tempfile.TemporaryDirectory() as run_dir:
        async with Experiment(cfg, run_dir=run_dir) as exp:
            training = exp.training
            await training.setup()
            await training.parts.endpoint.start()
            try:
                for way in WAYS:  # warm-up: each way's first calls, not counted
                    await one_round(training, way, -1, 1)
                for r in range(rounds):
                    for way in (WAYS if r % 2 == 0 else reversed(list(WAYS))):
                        for i, value in enumerate(await one_round(training, way, r, episodes)):
                            totals[way][i] += value
            finally:
                await training.parts.endpoint.stop()
                await training.parts.allocator.close()
    rows = []
    for way, (calls, samples, wall, cpu) in totals.items():
        rows.append({"way": way, "rounds": rounds, "episodes": episodes, "calls": calls, "samples": samples,
                     "samples_per_s": round(samples / wall, 2), "controller_cpu_ms_per_call": round(1e3 * cpu / calls, 3)})
    chat = rows[0]
    for way in rows[1:3]:
        rows.append({"way": f"{way['way']}/chat", "samples_per_s_ratio": round(way["samples_per_s"] / chat["samples_per_s"], 3),
                     "extra_cpu_ms_per_call": round(way["controller_cpu_ms_per_call"] - chat["controller_cpu_ms_per_call"], 3)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job-steps", type=int, default=10, help="steps of each job (0: the calls alone)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="one step of each job, one round of two episodes")
    args = p.parse_args()
    if args.smoke:
        args.job_steps, args.rounds, args.episodes = 1, 1, 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from flexmarl.runtime.aio import limit_threads, run_async

    limit_threads(1)
    if args.job_steps > 0:
        jobs = run_async(lambda: measure_jobs(args.job_steps))
        for row in jobs:
            print(json.dumps(row))
        print(f"\n{'job':>18} {'samples/s':>10}")
        for row in jobs[:2]:
            print(f"{row['job']:>18} {row['samples_per_s']:>10.2f}")
        print(f"endpoint job / chat job samples/s: {jobs[2]['samples_per_s_ratio']:.3f} (target >= {1 / 1.2:.3f})\n")
    rows = run_async(lambda: measure(args.rounds, args.episodes, args.group_size))
    for row in rows:
        print(json.dumps(row))
    print(f"\n{'way':>9} {'samples/s':>10} {'CPU ms/call':>12}")
    for row in rows[:3]:
        print(f"{row['way']:>9} {row['samples_per_s']:>10.2f} {row['controller_cpu_ms_per_call']:>12.3f}")
    for ratio in rows[3:]:
        print(f"calls alone, {ratio['way']} samples/s: {ratio['samples_per_s_ratio']:.3f}; "
              f"extra controller CPU per call: {ratio['extra_cpu_ms_per_call']:.3f} ms")


if __name__ == "__main__":
    main()
