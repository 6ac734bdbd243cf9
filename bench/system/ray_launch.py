"""The default job started by the Ray launcher against the local one, in one invocation.

Each run trains the embedded default job (same seed, steps and batch) through the Python
API (`Experiment`), one after the other in this process, alternating launchers for
--repeats rounds: `local` (workers as child processes of the controller) and `ray`
(workers as Ray actors on a Ray cluster). Without --address the cluster is Ray's own
multi-node test cluster, started here on this machine before the first run and not
counted: a head that runs only the controller and --nodes worker nodes of
--cpus-per-node CPUs, all on loopback (this machine's only network). Per run one JSON
line:

    launcher, round, steps, setup_s, train_s, samples, samples_per_s

setup_s is entering the Experiment: for Ray, joining the cluster and reserving the
placement group, then for both, starting every worker and waiting until each registered
(model building and engine start-up come after, inside train_s, alike for both); train_s
is the run's own wall time after set-up (RunSummary.wall_s), samples_per_s the samples it
trained over it. A last line gives each launcher's medians and the ratios ray/local. Ray
adds placement; past set-up the workers are the same processes on the same sockets.

    .venv/bin/python bench/system/ray_launch.py [--steps 6] [--repeats 2] [--nodes 2] [--address HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

# The simulated cluster's Ray processes bind and contact 127.0.0.1 only: Ray's single-host
# mode (read when Ray is first imported; inherited by its processes), without which Ray
# swaps a loopback address for this host's outside one (tests/integration/ray_nodes.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from flexmarl.controller import Experiment  # noqa: E402
from flexmarl.controller.tasks.digit_chain import default_config  # noqa: E402
from flexmarl.runtime.aio import limit_threads, setup_logging  # noqa: E402
from flexmarl.runtime.config import load_config  # noqa: E402

OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum: nothing of the run goes through it
LOOPBACK = "127.0.0.1"


def run_once(launcher: str, address: str, args: argparse.Namespace, round_: int) -> dict:
    cfg = load_config(None, [f"cluster.launcher='{launcher}'", f"ray.address='{address}'", f"run.steps={args.steps}",
                             f"run.seed={args.seed}", f"pipeline.queries_per_step={args.queries}",
                             "run.progress=false", *args.set], defaults=default_config())
    with tempfile.TemporaryDirectory() as run_dir:
        async def main():
            started = time.perf_counter()
            async with Experiment(cfg, run_dir=run_dir) as exp:
                setup_s = time.perf_counter() - started
                summary = await exp.train()
            return setup_s, summary

        setup_s, summary = asyncio.run(main())
    return {"launcher": launcher, "round": round_, "steps": summary.steps, "setup_s": round(setup_s, 2),
            "train_s": round(summary.wall_s, 2), "samples": summary.samples,
            "samples_per_s": round(summary.samples / summary.wall_s, 3)}


def medians(rows: list[dict]) -> dict:
    out: dict = {"measure": "medians"}
    for launcher in ("local", "ray"):
        mine = [r for r in rows if r["launcher"] == launcher]
        for key in ("setup_s", "samples_per_s"):
            out[f"{launcher}_{key}"] = round(statistics.median(r[key] for r in mine), 3)
    out["setup_ratio_ray_over_local"] = round(out["ray_setup_s"] / out["local_setup_s"], 2)
    out["samples_per_s_ratio_ray_over_local"] = round(out["ray_samples_per_s"] / out["local_samples_per_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--queries", type=int, default=8, help="pipeline.queries_per_step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="rounds, each a local run then a Ray run")
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes of the simulated cluster")
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--address", default="", help="an existing Ray cluster instead of a simulated one")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config override")
    args = parser.parse_args()
    limit_threads(1)
    setup_logging("WARNING", name="bench")

    cluster = None
    if not args.address:
        from ray.cluster_utils import Cluster

        started = time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=0, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, node_ip_address=LOOPBACK))
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.cpus_per_node, object_store_memory=OBJECT_STORE_BYTES,
                             node_ip_address=LOOPBACK)
        cluster.wait_for_nodes()
        print(json.dumps({"measure": "cluster_start", "nodes": args.nodes, "cpus_per_node": args.cpus_per_node,
                          "seconds": round(time.perf_counter() - started, 2)}), flush=True)
    address = args.address or cluster.address
    rows = []
    try:
        for round_ in range(args.repeats):
            for launcher in ("local", "ray"):
                rows.append(run_once(launcher, address, args, round_))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if cluster is not None:
            cluster.shutdown()
    print(json.dumps(medians(rows)), flush=True)


if __name__ == "__main__":
    main()
