"""Many agents as LoRA adapters of one base against the same agents as whole models.

One invocation runs, for each N in --agents, two short jobs through `flexmarl run` (real
processes) on the digit team's base model (examples/digit_team): N adapter agents of the
base (one rollout engine, one frozen base on the trainer) and N whole-model agents, each a
full copy of the base (one engine each, the least a whole-model job needs). For each it
reports, as a JSON row and in a table:

- rollout_rss_mb / trainer_rss_mb: the largest resident memory of all rollout workers
  together and of the trainer, sampled every 0.2 s while the job runs (psutil);
- sync_mb_per_step / sync_s_per_step: bytes and seconds of the weight syncs of one
  optimizer step, all agents (WeightSyncFinished events);
- samples_per_s: trained samples per second after set-up (the run's summary line);
- engine_start_s: the mean seconds an engine took to start (the controller's log).

The targets at N = 8: adapter rollout memory at most 1.5x that of one agent's engine,
adapter sync bytes at most 5% of the whole-model sync, adapter samples/s no lower than the
whole-model job's on the same cores.

    python bench/system/lora_agents.py --agents 2,4,8 --steps 4
    python bench/system/lora_agents.py --smoke        # N = 2, one step: the suite's smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
TEAM = ROOT / "examples" / "digit_team"
TASKS = ("sorter", "expander", "copier", "reverser")


def job_toml(n: int, adapters: bool, steps: int) -> str:
    model = f"tiny:{TEAM / 'models.py'}:base"
    agents = [f"{TASKS[i % len(TASKS)]}_{i}" for i in range(n)]
    lines = [f'[run]\nworkflow = "{TEAM / "workflow.py"}:episode"\nsteps = {steps}\nseed = 0\nprogress = false\n',
             # trainer_capacity 0 (the default): every agent resident, no swaps in either job
             f"[cluster]\nrollout_workers = {1 if adapters else n}\ntrainer_workers = 1\n",
             "[pipeline]\nmode = \"sync\"\nqueries_per_step = 4\nmicro_batch = 16\n",
             "[router]\nacross_agents = false\n"]
    if adapters:
        lines.append(f'[bases.team]\nmodel = "{model}"\n')
    for agent in agents:
        own = 'base = "team"' if adapters else f'model = "{model}"'
        lines.append(f"[agents.{agent}]\n{own}\ngroup_size = 4\nmax_tokens = 3\nignore_eos = true\n")
    return "\n".join(lines)


def watch_rss(root_pid: int, peak: dict[str, float], stop: threading.Event) -> None:
    """Keeps in `peak` the largest summed RSS (MB) of the rollout and trainer workers."""
    while not stop.is_set():
        now = {"rollout": 0.0, "trainer": 0.0}
        try:
            children = psutil.Process(root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                cmd = child.cmdline()
                role = cmd[cmd.index("--role") + 1] if "--role" in cmd else None
                if role in now:
                    now[role] += child.memory_info().rss / 2**20
            except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, IndexError):
                continue
        for role, mb in now.items():
            peak[role] = max(peak.get(role, 0.0), mb)
        stop.wait(0.2)


def run_one(n: int, adapters: bool, steps: int, out_dir: Path) -> dict:
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.eventlog import read_events

    name = f"{'adapters' if adapters else 'whole'}-{n}"
    config = out_dir / f"{name}.toml"
    config.write_text(job_toml(n, adapters, steps))
    run_dir = out_dir / name
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", "run", str(config), "--out",
                             str(run_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_rss, args=(proc.pid, peak, stop), daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{out[-3000:]}")
    events, _ = read_events(run_dir / "events.log")
    syncs = [e for e in events if isinstance(e, ev.WeightSyncFinished) and e.version > 0]
    starts = [float(s) for s in re.findall(r"engine at version \d+ \((\d+\.\d+)s to start\)", out)]
    rate = re.search(r"after set-up\): ([\d.]+) samples/s", out)
    return {"mode": "adapters" if adapters else "whole", "agents": n,
            "rollout_rss_mb": round(peak.get("rollout", 0.0), 1), "trainer_rss_mb": round(peak.get("trainer", 0.0), 1),
            "sync_mb_per_step": round(sum(e.nbytes for e in syncs) / steps / 1e6, 3),
            "sync_s_per_step": round(sum(e.seconds for e in syncs) / steps, 4),
            "samples_per_s": float(rate.group(1)) if rate else 0.0,
            "engines": len(starts), "engine_start_s": round(sum(starts) / len(starts), 2) if starts else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="2,4,8", help="the N to compare, comma-separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="N = 2, one step")
    args = parser.parse_args()
    ns = [2] if args.smoke else [int(x) for x in args.agents.split(",")]
    steps = 1 if args.smoke else args.steps
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora_agents-") as tmp:
        for n in ns:
            for adapters in (True, False):
                t0 = time.monotonic()
                row = run_one(n, adapters, steps, Path(tmp))
                row["wall_s"] = round(time.monotonic() - t0, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| N | mode | rollout RSS MB | trainer RSS MB | sync MB/step | sync s/step | samples/s | engines x start s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['agents']} | {r['mode']} | {r['rollout_rss_mb']} | {r['trainer_rss_mb']} | "
              f"{r['sync_mb_per_step']} | {r['sync_s_per_step']} | {r['samples_per_s']} | "
              f"{r['engines']} x {r['engine_start_s']} |")
    for n in ns:
        a = next(r for r in rows if r["agents"] == n and r["mode"] == "adapters")
        w = next(r for r in rows if r["agents"] == n and r["mode"] == "whole")
        one = w["rollout_rss_mb"] / n  # one whole-model engine
        print(f"N={n}: adapter rollout memory {a['rollout_rss_mb'] / one:.2f}x one agent's engine; adapter sync "
              f"bytes {100 * a['sync_mb_per_step'] / max(w['sync_mb_per_step'], 1e-9):.1f}% of the whole-model "
              f"sync; samples/s {a['samples_per_s'] / max(w['samples_per_s'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
