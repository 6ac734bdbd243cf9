"""The trainer against the machine's limit: FLOP/s of one trainer step as a fraction of a
plain matmul's, and its peak memory, on GRPO micro-batches of long-tailed lengths.

    python bench/micro/trainer_throughput.py [--shape qwen2.5-0.5b] [--tokens 4096,16384] [--reps 1]
        [--checkpointing off,on] [--prompts 64,512] [--outputs 16,1024] [--models DIR] [--out FILE]
    python bench/micro/trainer_throughput.py --smoke      # tiny shape, seconds (the suite runs it)

A step is FlexMARL's own trainer (TrainerHandler): TRAIN_MICROBATCH then OPTIM_STEP, on a
model of a real shape built from its config (scripts/gpu_check.py's SHAPES, random weights,
float32 on the CPU, bfloat16 "mixed" on CUDA). A micro-batch holds whole GRPO groups
(--group-size samples of one prompt); prompt lengths are uniform on 64-512, output lengths
log-uniform on 16-1,024 (long-tailed: median 128, mean 242; --prompts and --outputs
change the ranges); groups are drawn until the
next one would pass --tokens (a group's tokens: its prompt once, plus its outputs). The
draw is seeded, so every invocation trains the same micro-batches.

FLOPs are counted from the tokens actually trained, not from what a kernel happens to
compute: per group the prompt once and each output (its last token is never an input);
2 x the decoder's matmul weights per input token, 2 x hidden x vocabulary per scored token,
4 x context x heads x head_dim per input token per layer for attention (the keys it may
attend to: its prompt and its own earlier tokens); backward twice the forward. Activation
checkpointing's recomputation is not counted. The limit is a plain square matmul of the
compute dtype, timed in the same process just before and just after the steps (the better
of the two: on a shared machine the rate moves).

Each (tokens, checkpointing) runs in a child process of its own, so that its peak memory is
its own: on the CPU the peak resident set (VmHWM) and what it adds to the resident state
before the step (weights and optimizer state, after a warm-up step on one short group); on
CUDA torch's peak allocation. On the CPU the child's address space is capped
(--memory-cap-gib, default: the machine's available memory less 2 GiB): a step that needs
more fails with an allocation error, reported as not fitting, instead of pushing other
processes out, with what it held at that moment plus what it asked for (a lower bound
of the peak it needed).

One JSON row per measurement, then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GIB = 2**30
PROMPT_LENGTHS = (64, 512)
OUTPUT_LENGTHS = (16, 1024)


# ------------------------------------------------------------------------- micro-batches


def draw_groups(budget: int, group_size: int, seed: int, prompts: tuple[int, int] = PROMPT_LENGTHS,
                outputs: tuple[int, int] = OUTPUT_LENGTHS) -> list[tuple[int, list[int]]]:
    """(prompt length, output lengths) of whole groups, drawn until the next would pass
    `budget` tokens (at least one group)."""
    rng = random.Random(seed)
    groups, total = [], 0
    while True:
        prompt = rng.randint(*prompts)
        outs = [round(math.exp(rng.uniform(math.log(outputs[0]), math.log(outputs[1])))) for _ in range(group_size)]
        size = prompt + sum(outs)
        if groups and total + size > budget:
            return groups
        groups.append((prompt, outs))
        total += size


def micro_batch(groups: list[tuple[int, list[int]]], vocab: int, seed: int) -> list:
    """The groups as the controller sends them: random token ids, advantages of both signs."""
    from flexmarl.runtime.keys import GroupKey
    from flexmarl.workers.trainer.batch import train_group

    rng = random.Random(seed)
    sent = []
    for g, (prompt_len, outs) in enumerate(groups):
        prompt = [rng.randrange(4, vocab) for _ in range(prompt_len)]
        outputs = [[rng.randrange(4, vocab) for _ in range(n)] for n in outs]
        sent.append(train_group(GroupKey("bench", "agent", f"g{g}"), prompt, outputs,
                                [1.0 if i % 2 else -1.0 for i in range(len(outs))], [[-1.0] * n for n in outs]))
    return sent


def train_flops(config, groups: list[tuple[int, list[int]]]) -> dict[str, float]:
    """Forward + backward FLOPs of the tokens the micro-batch trains (see the module docstring)."""
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = config.num_key_value_heads
    matmul_weights = layers * (hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
                               + 3 * hidden * config.intermediate_size)
    inputs = scored = contexts = 0
    for prompt, outs in groups:
        inputs += prompt + sum(n - 1 for n in outs)
        scored += sum(outs)
        contexts += prompt * (prompt + 1) // 2  # token t of the prompt attends to t + 1 keys
        contexts += sum((n - 1) * prompt + n * (n - 1) // 2 for n in outs)  # output input j: prompt + j + 1
    forward = (2 * matmul_weights * inputs + 2 * hidden * config.vocab_size * scored
               + 4 * layers * heads * head_dim * contexts)
    return {"flops": 3.0 * forward, "tokens": sum(p for p, _ in groups) + scored, "input_tokens": inputs,
            "scored_tokens": scored,
            "attention_share": 4 * layers * heads * head_dim * contexts / forward}


# ------------------------------------------------------------------------- the child


def matmul_flops_per_s(device, dtype, size: int, reps: int = 3) -> float:
    """A plain square matmul's FLOP/s: the best of `reps`."""
    import torch
    from real_shapes import sync

    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(reps + 1):  # the first is a warm-up
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(spec: dict) -> dict:
    """One (tokens, checkpointing) measurement in this process, its address space capped
    on the CPU."""
    if spec["device"] == "cpu" and spec["memory_cap_gib"] > 0:
        cap = int(spec["memory_cap_gib"] * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return measure(**{k: v for k, v in spec.items() if k != "memory_cap_gib"})


def measure(shape: str, model: str, device: str, tokens: int, checkpointing: bool, group_size: int, seed: int,
            reps: int, matmul_size: int, prompts: tuple[int, int] = PROMPT_LENGTHS,
            outputs: tuple[int, int] = OUTPUT_LENGTHS, profile: int = 0, compile_layers: bool = False) -> dict:
    """A trainer step on the micro-batch of `tokens` drawn with `seed`: its FLOP/s against
    the matmul's, and its peak memory over what the agent holds between steps."""
    import torch
    from real_shapes import Trainer, sync
    from transformers import AutoConfig

    from flexmarl.runtime import protocol

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device(device)
    config = AutoConfig.from_pretrained(model)
    groups = draw_groups(tokens, group_size, seed, tuple(prompts), tuple(outputs))
    batch = micro_batch(groups, config.vocab_size, seed)
    row = {"shape": shape, "device": str(device), "budget_tokens": tokens, "compile_layers": compile_layers,
           "activation_checkpointing": checkpointing, "groups": len(groups),
           "samples": sum(len(g.lengths) for g in batch),
           "prompt_lengths": [p for p, _ in groups], "output_lengths": [n for _, outs in groups for n in outs],
           **train_flops(config, groups)}
    dtype = {"cpu": "float32", "cuda": "bfloat16"}[device.type]
    matmul = [matmul_flops_per_s(device, getattr(torch, dtype), matmul_size)]
    trainer = Trainer()
    try:
        settings = protocol.TrainerSettings(dtype=dtype, precision="mixed" if device.type == "cuda" else "pure",
                                            activation_checkpointing=checkpointing, compile_layers=compile_layers)
        trainer.init("a", Path(model), settings)
        # The optimizer state exists from the first step on: a short group makes it.
        trainer.iteration("a", 1, micro_batch([(64, [16, 16])], config.vocab_size, seed + 1))
        steps = timed_steps(trainer, batch, reps, device)
        if profile and steps.get("fits"):
            steps["profile"] = profiled_step(trainer, batch, device, profile, version=2 + reps)
        # Timed again after the steps: on a shared machine the rate moves, and the limit is
        # the best it reached.
        matmul.append(matmul_flops_per_s(device, getattr(torch, dtype), matmul_size))
        return {**row, "dtype": dtype, "matmul_flops_per_s": max(matmul), "matmul_before_after": matmul, **steps}
    finally:
        trainer.close()
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()


def timed_steps(trainer, batch: list, reps: int, device) -> dict:
    """The fastest of `reps` steps, and the peak memory over the resident state."""
    import torch
    from real_shapes import sync

    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    else:
        resident = vm_kib("VmRSS") * 1024
    times = []
    try:
        for rep in range(reps):
            sync(device)
            t0 = time.perf_counter()
            done = trainer.iteration("a", 2 + rep, batch)
            sync(device)
            times.append(time.perf_counter() - t0)
    except (RuntimeError, MemoryError) as exc:
        if not ("alloc" in str(exc) or isinstance(exc, MemoryError) or "out of memory" in str(exc)):
            raise
        # What it held when an allocation failed, plus what it asked for: its peak would have
        # been at least that much.
        asked = re.search(r"allocate (\d+) bytes", str(exc))
        held = vm_kib("VmRSS") * 1024 if device.type == "cpu" else torch.cuda.memory_allocated(device)
        needed = (held + int(asked.group(1))) / GIB if asked else None
        return {"ok": False, "fits": False, "needs_at_least_gib": needed, "resident_gib": resident / GIB,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else vm_kib("VmHWM") * 1024
    seconds = min(times)
    return {"ok": math.isfinite(done.stats.loss), "fits": True, "reps": reps, "seconds": seconds,
            "seconds_all": times, "resident_gib": resident / GIB, "peak_gib": peak / GIB,
            "step_gib": (peak - resident) / GIB, "loss": done.stats.loss, "grad_norm": done.grad_norm}


def profiled_step(trainer, batch: list, device, top: int, version: int) -> dict:
    """One more step under torch's profiler: the `top` operators by their own time on the
    device (CUDA) or the CPU, with calls and milliseconds, and the step's total."""
    import torch
    from real_shapes import sync
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.iteration("a", version, batch)
        sync(device)
    seconds = time.perf_counter() - t0
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    busy_ms = sum(getattr(e, attr) for e in events) / 1e3
    return {"seconds": seconds, "busy_ms": busy_ms, "by": attr,
            "top": [[e.key[:80], e.count, round(getattr(e, attr) / 1e3, 3)] for e in events[:top]]}


def rates(row: dict) -> dict:
    """A measured row with its FLOP/s, share of the matmul's and tokens/s."""
    if not row.get("fits"):
        return row
    flops_per_s = row["flops"] / row["seconds"]
    return {**row, "flops_per_s": flops_per_s, "of_matmul": flops_per_s / row["matmul_flops_per_s"],
            "tokens_per_s": row["tokens"] / row["seconds"]}


# ------------------------------------------------------------------------- the parent


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def table(rows: list[dict]) -> str:
    lines = [f"{'shape':<14} {'tokens':>7} {'ckpt':<5} {'comp':<5} {'samples':>7} {'step s':>8} {'TFLOP/s':>8} "
             f"{'matmul':>8} {'of matmul':>9} {'peak GiB':>9} {'step GiB':>9}"]
    for r in rows:
        head = (f"{r['shape']:<14} {r['tokens']:>7} "
                f"{'on' if r['activation_checkpointing'] else 'off':<5} "
                f"{'on' if r.get('compile_layers') else 'off':<5} {r['samples']:>7}")
        if r.get("fits", True) and "seconds" in r:
            lines.append(f"{head} {r['seconds']:>8.2f} {r['flops_per_s'] / 1e12:>8.3f} "
                         f"{r['matmul_flops_per_s'] / 1e12:>8.3f} {r['of_matmul']:>9.2f} {r['peak_gib']:>9.2f} "
                         f"{r['step_gib']:>9.2f}")
        else:
            at_least = f"needs at least {r['needs_at_least_gib']:.2f} GiB: " if r.get("needs_at_least_gib") else ""
            lines.append(f"{head}  {at_least}{r.get('error', 'failed')[:90]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--tokens", default="4096,16384", help="micro-batch token budgets")
    parser.add_argument("--checkpointing", default="off", help="activation checkpointing: off, on or off,on")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompts", default="64,512", help="prompt lengths: uniform on MIN,MAX")
    parser.add_argument("--outputs", default="16,1024", help="output lengths: log-uniform on MIN,MAX")
    parser.add_argument("--reps", type=int, default=1, help="timed steps per micro-batch (the fastest is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matmul-size", type=int, default=0, help="default: 2048 on the CPU, 8192 on CUDA")
    parser.add_argument("--memory-cap-gib", type=float, default=-1.0,
                        help="CPU: the child's address-space cap (default: available memory less 2 GiB; 0: none)")
    parser.add_argument("--models", default="", help="where to build the model (default: a temporary directory)")
    parser.add_argument("--device", default="", help="cpu or cuda:0 (default: cuda:0 where there is one)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape and budgets, for the test suite")
    parser.add_argument("--compile", default="off", help="torch.compile the norms and MLPs: off, on or off,on")
    parser.add_argument("--profile", type=int, default=0,
                        help="after the timed steps, one more under torch's profiler: its N costliest operators")
    parser.add_argument("--out", default="", help="also write the JSON rows here")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0

    import torch
    from real_shapes import SHAPES, build_model

    if args.smoke:
        args.shape, args.tokens, args.checkpointing, args.reps = "tiny-qwen2", "512", "off,on", 1
    if args.shape not in SHAPES:
        parser.error(f"unknown shape {args.shape!r}; known: {', '.join(SHAPES)}")
    device = torch.device(args.device or ("cuda:0" if torch.cuda.device_count() else "cpu"))
    matmul_size = args.matmul_size or (8192 if device.type == "cuda" else (256 if args.smoke else 2048))
    cap = args.memory_cap_gib if args.memory_cap_gib >= 0 else max(1.0, available_gib() - 2.0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.models) if args.models else Path(tmp)
        path = build_model(args.shape, root, device)
        runs = [(c == "on", int(t), k == "on") for k in args.compile.split(",") for c in args.checkpointing.split(",")
                for t in args.tokens.split(",")]
        for checkpointing, tokens, compiled in runs:
            spec = {"shape": args.shape, "model": str(path), "device": str(device), "tokens": tokens,
                    "checkpointing": checkpointing, "group_size": args.group_size, "seed": args.seed + tokens,
                    "reps": args.reps, "matmul_size": matmul_size, "memory_cap_gib": 0 if args.smoke else cap,
                    "prompts": [int(n) for n in args.prompts.split(",")],
                    "outputs": [int(n) for n in args.outputs.split(",")], "profile": args.profile,
                    "compile_layers": compiled}
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT,
                                  capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode == 0 and lines:
                row = {**rates(json.loads(lines[-1])), "memory_cap_gib": spec["memory_cap_gib"]}
            else:
                row = {"shape": args.shape, "budget_tokens": tokens, "activation_checkpointing": checkpointing,
                       "ok": False, "error": f"child exited {proc.returncode}: {proc.stderr.strip()[-300:]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            for name, calls, ms in row.get("profile", {}).get("top", []):
                print(f"    {ms:10.3f} ms {calls:6d}x  {name}", flush=True)
    print(table([r for r in rows if "input_tokens" in r]), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0 if all(r["ok"] or r.get("fits") is False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
