"""Where a Ray cluster puts each worker: the resources it asks for and the bundle of the
run's placement group it goes into. Plain decisions over the config; no Ray here.

A worker asks for CPUs (`cluster.threads_per_worker` for each of its ranks: a trainer's
group, a rollout engine's tensor-parallel ranks, an environment worker's processes) and
GPUs; an environment worker never asks for a GPU (and is shown none). Its GPUs come from the
`cluster.rollout_gpus` / `cluster.trainer_gpus` lists where given; with Ray their numbers
name GPUs within the run, not devices of a host (Ray picks the devices): workers whose
lists share a number share that GPU, so they are one bundle, which Ray keeps on one node,
and each asks for its share of it (1/k of a GPU that k workers share, so Ray hands them
the same device). Ray's fractions cannot split several GPUs between workers, so a shared
GPU must be the only GPU of every worker that shares it. With empty lists,
`ray.use_gpus` gives each worker GPUs of its own, one per rank; otherwise none.

It does not know how the plan becomes a placement group or actors (ray_launcher.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from flexmarl.runtime.config import ClusterConfig, ConfigError, RayConfig


@dataclass(frozen=True)
class WorkerResources:
    cpus: float
    gpus: float  # whole GPUs, or its share (< 1) of the one GPU it shares
    bundle: int  # index into PlacementPlan.bundles


@dataclass(frozen=True)
class PlacementPlan:
    bundles: list[dict[str, float]]  # Ray resource dicts, in the order of their first worker
    workers: dict[str, WorkerResources]  # by worker id: rollout-0, ..., trainer-0, ...

    def describe(self) -> str:
        """What the whole run asks for, e.g. "4 CPUs, 2 GPUs in 3 bundles"."""
        return f"{describe_resources(total(self.bundles))} in {len(self.bundles)} bundles"


def plan_placement(cluster: ClusterConfig, ray: RayConfig, widest_engine: int, env_processes: int = 1) -> PlacementPlan:
    """The placement of every worker of `cluster`; ConfigError for GPUs Ray cannot share."""
    ranks = {"rollout": widest_engine, "trainer": cluster.trainer_group_size, "env": env_processes}
    roles = {f"{role}-{i}": role for role, n in (("rollout", cluster.rollout_workers),
                                                  ("trainer", cluster.trainer_workers),
                                                  ("env", cluster.env_workers)) for i in range(n)}
    cpus = {w: float(cluster.threads_per_worker * ranks[role]) for w, role in roles.items()}
    labels = {w: _gpu_labels(cluster, ray, w, ranks[role]) for w, role in roles.items()}
    holders: dict[str, list[str]] = defaultdict(list)
    for worker_id, gpus in labels.items():
        for gpu in gpus:
            holders[gpu].append(worker_id)
    _check_sharing(holders, labels)
    bundles: list[dict[str, float]] = []
    bundle_of: dict[str, int] = {}  # a group's first worker -> the group's bundle
    placed: dict[str, WorkerResources] = {}
    for worker_id, gpus in labels.items():
        # Sharing is never transitive (a shared GPU is its holders' only one): a group is
        # the holders of one GPU, or one worker.
        group = holders[gpus[0]] if len(gpus) == 1 else [worker_id]
        if group[0] not in bundle_of:
            bundle_of[group[0]] = len(bundles)
            gpu_count = len({g for w in group for g in labels[w]})
            bundles.append({"CPU": sum(cpus[w] for w in group), **({"GPU": float(gpu_count)} if gpu_count else {})})
        share = _share(len(group)) if len(gpus) == 1 else float(len(gpus))
        placed[worker_id] = WorkerResources(cpus[worker_id], share, bundle_of[group[0]])
    return PlacementPlan(bundles, placed)


def _gpu_labels(cluster: ClusterConfig, ray: RayConfig, worker_id: str, ranks: int) -> list[str]:
    role, i = worker_id.rsplit("-", 1)
    if role == "env":  # CPU work only
        return []
    lists = cluster.rollout_gpus if role == "rollout" else cluster.trainer_gpus
    if lists:
        return [f"GPU {g}" for g in lists[int(i)]]
    if ray.use_gpus and not (cluster.rollout_gpus or cluster.trainer_gpus):
        return [f"{worker_id}'s GPU {r}" for r in range(ranks)]  # its own, shared with no one
    return []


def _check_sharing(holders: dict[str, list[str]], labels: dict[str, list[str]]) -> None:
    for gpu, workers in holders.items():
        wide = [w for w in workers if len(labels[w]) > 1]
        if len(workers) > 1 and wide:
            raise ConfigError(
                f"with cluster.launcher = \"ray\", a GPU that workers share must be the only GPU of each of them "
                f"({gpu} is shared by {', '.join(workers)}, and {wide[0]} has {len(labels[wide[0]])}): Ray "
                f"cannot split several GPUs between workers; give the shared GPUs to one-GPU workers, or use "
                f"the local launcher")


def _share(holders: int) -> float:
    """1/holders of a GPU, rounded down to Ray's resolution (1e-4) so the shares fit in it."""
    return 1.0 if holders == 1 else math.floor(10_000 / holders) / 10_000


def total(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for bundle in bundles:
        for name, amount in bundle.items():
            out[name] += amount
    return dict(out)


def describe_resources(resources: dict[str, float]) -> str:
    """The CPUs and GPUs of a Ray resource dict, e.g. "4 CPUs, 1 GPU"."""
    return ", ".join(f"{resources.get(name, 0):g} {name}{'' if resources.get(name, 0) == 1 else 's'}"
                     for name in ("CPU", "GPU") if name == "CPU" or resources.get(name, 0))
