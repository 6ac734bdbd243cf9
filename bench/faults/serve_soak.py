"""Soak: concurrent OpenAI clients against a FlexMARL endpoint for a long while; prints the
requests, the errors, the latency (p50, p99) and every process's memory (VmRSS) at the
start, the middle and the end of the load, with its slope over the second half.

Two targets, each real processes (controller, vLLM rollout workers, torch trainer):

    serve   `flexmarl serve RUN_DIR` of a one-step run of the review chain's verifier (a
            model with a chat template), then --clients clients in this process, each
            calling in a loop: a chat completion of a question drawn from a pool, n of 1,
            2 or 4, max_tokens 2 to 8; a --hostile share of the calls is malformed on
            purpose (n = 0, a 6 MiB message, JSON nested 100,000 deep) and must be refused
            with a 400 (counted apart: "refused as meant");
    train   `flexmarl run` of a job whose episodes make their calls as an agent written
            for the OpenAI API does: through the run's endpoint over HTTP with the
            episode's key (--clients episodes at once: pipeline.max_concurrent_episodes),
            each timing its own calls into a file the bench reads; stopped with Ctrl-C
            after --minutes.

An error is any other answer than the one meant: a 5xx, a 4xx to a good request, no
answer within 120 s, a refused connection. Memory is read from /proc every --sample-s
seconds for the controller (`flexmarl serve` or `flexmarl run`) and each worker.

    python bench/faults/serve_soak.py --target serve --minutes 30 --clients 100
    python bench/faults/serve_soak.py --target train --minutes 30 --clients 64

Latency depends on the machine's load: on a shared machine, say so beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flexmarl.controller.testing import faults as fm

ROOT = Path(__file__).resolve().parents[2]
CRITIC = f"tiny:{ROOT}/examples/review_chain/models.py:verifier"
QUESTIONS = [f"Question: What is {a} + {b}? Answer: {a + b}" for a in range(1, 6) for b in range(1, 6)]

JOB = f'''
[run]
workflow = "flow.py:episode"
steps = STEPS
checkpoint_every = 10

[cluster]
rollout_workers = ROLLOUTS
trainer_workers = 1

[pipeline]
mode = "async"
max_staleness = 1
queries_per_step = QUERIES
max_concurrent_episodes = QUERIES

[openai]
enabled = true

[agents.critic]
model = "{CRITIC}"
group_size = 2
max_tokens = 6
'''

# The training target's episodes: an HTTP client of their own with the episode's key (as
# agent code handed a base URL and a key would be), each call timed into CALLS_FILE.
FLOW = '''
import json
import os
import random
import time

import openai

CALLS = os.environ["SOAK_CALLS_FILE"]
QUESTIONS = QUESTIONS_LIST


async def episode(ctx):
    client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.openai_api_key, max_retries=0,
                                timeout=120)
    question = random.Random(ctx.episode_id).choice(QUESTIONS)
    t0, status = time.monotonic(), -1  # -1: the episode was cancelled before an answer (the run stopping)
    try:
        reply = await client.chat.completions.create(model="critic", messages=[{"role": "user", "content": question}])
        status = 200
    except openai.APIStatusError as exc:
        status = exc.status_code
        raise
    except openai.APIError:
        status = 0
        raise
    finally:
        with open(CALLS, "a") as f:
            f.write(json.dumps({"t": time.time(), "s": status, "ms": (time.monotonic() - t0) * 1000}) + "\\n")
        await client.close()
    ctx.reward(reply.id, [float(len(c.message.content or "")) for c in reply.choices])
'''.replace("QUESTIONS_LIST", repr(QUESTIONS))


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                FLEXMARL_MODEL_CACHE=os.environ.get("FLEXMARL_MODEL_CACHE") or str(ROOT / ".cache" / "models"))


def flexmarl(*args: str, stderr, extra: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", *args], cwd=ROOT,
                            env={**env(), **(extra or {})}, stdout=subprocess.PIPE, stderr=stderr, text=True)


@dataclass
class Load:
    latencies_ms: list[float] = field(default_factory=list)  # answers as meant
    meant_refusals: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # what went wrong -> times

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


@dataclass
class Memory:
    series: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)

    def sample(self, processes: dict[str, int], t: float) -> None:
        for name, pid in processes.items():
            mib = fm.rss_mib(pid)
            if mib is not None:
                self.series.setdefault((name, pid), []).append((t, mib))


# ---------------------------------------------------------------- serve


def train_one_step(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.toml").write_text(JOB.replace("STEPS", "1").replace("ROLLOUTS", "1").replace("QUERIES", "2"))
    (folder / "flow.py").write_text(
        "async def episode(ctx):\n"
        "    await ctx.chat('critic', [{'role': 'user', 'content': 'Question: What is 2 + 3? Answer: 5'}])\n"
        "    ctx.reward_all('critic', lambda s: float(len(s.text)))\n")
    with open(folder / "train.stderr", "w") as err:
        proc = flexmarl("run", str(folder / "job.toml"), "--out", str(folder / "run"), "--no-progress", stderr=err)
        proc.communicate(timeout=1800)
    if proc.returncode:
        sys.exit(f"the one-step run failed ({proc.returncode}): {(folder / 'train.stderr').read_text()[-2000:]}")
    return folder / "run"


# The malformed requests, made once (every client sends the same bytes).
DEEP = b'{"model": "critic", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HUGE = json.dumps({"model": "critic", "messages": [{"role": "user", "content": "7 " * (3 * 1024 * 1024)}]}).encode()
N0 = json.dumps({"model": "critic", "messages": [{"role": "user", "content": "hi"}], "n": 0}).encode()


async def client_loop(http, rng: random.Random, load: Load, hostile: float, until: float) -> None:
    while time.monotonic() < until:
        bad = rng.random() < hostile
        if bad:
            request = {"content": rng.choice([N0, HUGE, DEEP]), "headers": {"content-type": "application/json"}}
        else:
            request = {"json": {"model": "critic", "n": rng.choice([1, 2, 4]), "max_tokens": rng.randint(2, 8),
                                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}}
        t0 = time.monotonic()
        try:
            answer = await http.post("/chat/completions", **request)
        except Exception as exc:  # no answer: counted, and on
            load.error(type(exc).__name__)
            continue
        ms = (time.monotonic() - t0) * 1000
        if bad and answer.status_code == 400:
            load.meant_refusals += 1
        elif not bad and answer.status_code == 200:
            load.latencies_ms.append(ms)
        else:
            load.error(f"HTTP {answer.status_code}{' to a malformed request' if bad else ''}")


async def serve_soak(args: argparse.Namespace) -> tuple[Load, Memory, float]:
    import httpx

    run_dir = train_one_step(args.out / "trained")
    stderr_path = args.out / "serve.stderr"
    with open(stderr_path, "w") as err:
        proc = flexmarl("serve", str(run_dir), stderr=err)
    load, memory = Load(), Memory()
    try:
        line = ""
        while "serving" not in line and proc.poll() is None:
            line = await asyncio.to_thread(proc.stdout.readline)
        if proc.poll() is not None:
            sys.exit(f"flexmarl serve exited: {stderr_path.read_text()[-2000:]}")
        url = line.rsplit(" at ", 1)[1].strip()
        workers = {ln.split("started rollout worker ")[1].split(" ")[0]: int(ln.split("(pid ")[1].split(")")[0])
                   for ln in stderr_path.read_text().splitlines() if "started rollout worker" in ln}
        processes = {"serve": proc.pid, **workers}
        t0 = time.monotonic()
        until = t0 + args.minutes * 60
        limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            clients = [asyncio.create_task(client_loop(http, random.Random(i), load, args.hostile, until))
                       for i in range(args.clients)]
            while time.monotonic() < until:
                memory.sample(processes, time.monotonic() - t0)
                await asyncio.sleep(args.sample_s)
            await asyncio.gather(*clients)
        memory.sample(processes, time.monotonic() - t0)
        return load, memory, time.monotonic() - t0
    finally:
        fm.interrupt(proc, timeout=120)


# ---------------------------------------------------------------- train


def train_soak(args: argparse.Namespace) -> tuple[Load, Memory, float]:
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.eventlog import LogTail

    folder = args.out / "train"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.toml").write_text(JOB.replace("STEPS", "100000").replace("ROLLOUTS", str(args.rollout_workers))
                                     .replace("QUERIES", str(args.clients)))
    (folder / "flow.py").write_text(FLOW)
    calls = folder / "calls.jsonl"
    calls.unlink(missing_ok=True)
    with open(folder / "run.stderr", "w") as err:
        proc = flexmarl("run", str(folder / "job.toml"), "--out", str(folder / "run"), "--no-progress", stderr=err,
                        extra={"SOAK_CALLS_FILE": str(calls)})
    memory, processes = Memory(), {"controller": proc.pid}
    tail = None
    try:
        while not calls.exists():  # set-up: models, engines
            if proc.poll() is not None:
                sys.exit(f"flexmarl run exited: {(folder / 'run.stderr').read_text()[-2000:]}")
            time.sleep(1.0)
        t0 = time.monotonic()
        until = t0 + args.minutes * 60
        while time.monotonic() < until and proc.poll() is None:
            if tail is None and (folder / "run" / "events.log").exists():
                tail = LogTail(folder / "run" / "events.log")
            for e in tail.poll() if tail is not None else []:
                if isinstance(e, ev.WorkerJoined):
                    processes[e.worker] = e.pid
            memory.sample(processes, time.monotonic() - t0)
            time.sleep(args.sample_s)
        memory.sample(processes, time.monotonic() - t0)
        elapsed = time.monotonic() - t0
    finally:
        fm.interrupt(proc, timeout=180)
    load = Load()
    for line in calls.read_text().splitlines():
        call = json.loads(line)
        if call["s"] == -1:
            continue  # a call the run's own stop cancelled (Ctrl-C after --minutes): not an answer, not an error
        if call["s"] == 200:
            load.latencies_ms.append(call["ms"])
        else:
            load.error(f"HTTP {call['s']}" if call["s"] else "no answer")
    return load, memory, elapsed


# ---------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def slope_mib_per_min(series: list[tuple[float, float]]) -> float | None:
    half = series[len(series) // 2:]
    if len(half) < 3 or half[-1][0] - half[0][0] <= 0:
        return None
    ts, ms = [t for t, _ in half], [m for _, m in half]
    mt, mm = statistics.fmean(ts), statistics.fmean(ms)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (m - mm) for t, m in zip(ts, ms)) / var * 60 if var else None


def report(args: argparse.Namespace, load: Load, memory: Memory, elapsed: float) -> None:
    answered = len(load.latencies_ms)
    errors = sum(load.errors.values())
    print(f"\nserve_soak: target {args.target}, {elapsed / 60:.1f} min, {args.clients} clients"
          + (f", {args.hostile:.0%} malformed on purpose" if args.target == "serve" else ""))
    print(f"  requests: {answered + load.meant_refusals + errors} ({answered / elapsed:.1f}/s answered), answered "
          f"{answered}, refused as meant {load.meant_refusals}, errors {errors}"
          + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(load.errors.items()))})" if errors else ""))
    print(f"  latency of the answered: p50 {percentile(load.latencies_ms, 0.5):.0f} ms, "
          f"p99 {percentile(load.latencies_ms, 0.99):.0f} ms")
    print("  memory (VmRSS, MiB): start, middle, end; slope over the second half")
    for (name, pid), series in sorted(memory.series.items()):
        middle = min(series, key=lambda s: abs(s[0] - series[-1][0] / 2))
        slope = slope_mib_per_min(series)
        print(f"    {name:<12} pid {pid:<8} {series[0][1]:8.1f} {middle[1]:8.1f} {series[-1][1]:8.1f}  "
              f"{'%+.2f MiB/min' % slope if slope is not None else '(too short)'}")
    print(json.dumps({"target": args.target, "minutes": round(elapsed / 60, 2), "clients": args.clients,
                      "answered": answered, "meant_refusals": load.meant_refusals, "errors": errors,
                      "p50_ms": round(percentile(load.latencies_ms, 0.5), 1),
                      "p99_ms": round(percentile(load.latencies_ms, 0.99), 1),
                      "rss_mib": {f"{n}:{p}": [round(s[0][1], 1), round(s[-1][1], 1)]
                                  for (n, p), s in sorted(memory.series.items())}}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["serve", "train"], default="serve")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--hostile", type=float, default=0.02, help="serve: the share of calls malformed on purpose")
    ap.add_argument("--rollout-workers", type=int, default=2, help="train: rollout workers")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=Path("runs/serve_soak"))
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    load, memory, elapsed = asyncio.run(serve_soak(args)) if args.target == "serve" else train_soak(args)
    report(args, load, memory, elapsed)
    return 1 if load.errors or not load.latencies_ms else 0


if __name__ == "__main__":
    sys.exit(main())
