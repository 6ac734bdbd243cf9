"""What a Ray cluster is asked for: each worker's CPUs and GPUs and its bundle, from the
config alone (no Ray)."""

import pytest

from flexmarl.controller.launch.ray_placement import describe_resources, plan_placement
from flexmarl.runtime.config import ConfigError, load_config


def plan(*overrides, widest_engine=1):
    cfg = load_config(None, list(overrides))
    return plan_placement(cfg.cluster, cfg.ray, widest_engine)


def test_a_cpu_job_gives_every_worker_a_bundle_of_its_own_threads_and_no_gpu():
    p = plan("cluster.rollout_workers=3", "cluster.trainer_workers=1", "cluster.threads_per_worker=2")
    assert p.bundles == [{"CPU": 2.0}] * 4
    assert {w: (r.cpus, r.gpus, r.bundle) for w, r in p.workers.items()} == {
        "rollout-0": (2.0, 0.0, 0), "rollout-1": (2.0, 0.0, 1), "rollout-2": (2.0, 0.0, 2), "trainer-0": (2.0, 0.0, 3)}
    assert p.describe() == "8 CPUs in 4 bundles"


def test_ranks_multiply_cpus_and_use_gpus_gives_one_gpu_of_its_own_per_rank():
    p = plan("cluster.rollout_workers=1", "cluster.trainer_workers=1", "cluster.trainer_group_size=2",
             "ray.use_gpus=true", widest_engine=4)
    assert p.bundles == [{"CPU": 4.0, "GPU": 4.0}, {"CPU": 2.0, "GPU": 2.0}]
    assert (p.workers["rollout-0"].gpus, p.workers["trainer-0"].gpus) == (4.0, 2.0)


def test_workers_that_share_a_gpu_are_one_bundle_each_asking_for_its_share():
    # A trainer and two engines on GPU 0, one engine alone on GPU 1.
    p = plan("cluster.rollout_workers=3", "cluster.trainer_workers=1", "cluster.rollout_gpus=[[0], [0], [1]]",
             "cluster.trainer_gpus=[[0]]")
    assert p.bundles == [{"CPU": 3.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    shares = {w: (r.gpus, r.bundle) for w, r in p.workers.items()}
    assert shares == {"rollout-0": (0.3333, 0), "rollout-1": (0.3333, 0), "rollout-2": (1.0, 1),
                      "trainer-0": (0.3333, 0)}
    assert sum(r.gpus for r in p.workers.values() if r.bundle == 0) <= 1.0  # the shares fit the one GPU


def test_a_gpu_shared_with_a_worker_of_several_gpus_is_refused_naming_them():
    with pytest.raises(ConfigError) as refused:
        plan("cluster.rollout_workers=1", "cluster.trainer_workers=1", "cluster.rollout_gpus=[[0]]",
             "cluster.trainer_gpus=[[0, 1]]", "cluster.trainer_group_size=2")
    assert "GPU 0 is shared by rollout-0, trainer-0, and trainer-0 has 2" in str(refused.value)
    assert "local launcher" in str(refused.value)


def test_resources_read_as_cpus_and_gpus():
    assert describe_resources({"CPU": 4.0, "GPU": 1.0, "memory": 1e9}) == "4 CPUs, 1 GPU"
    assert describe_resources({"CPU": 1.0}) == "1 CPU"


def test_an_environment_worker_asks_for_a_cpu_per_process_and_never_for_a_gpu():
    cfg = load_config(None, ["cluster.rollout_workers=1", "cluster.trainer_workers=1", "cluster.env_workers=2",
                             "env.processes=3", "ray.use_gpus=true"])
    p = plan_placement(cfg.cluster, cfg.ray, 1, cfg.env.processes)
    assert {w: (r.cpus, r.gpus) for w, r in p.workers.items() if w.startswith("env")} == {
        "env-0": (3.0, 0.0), "env-1": (3.0, 0.0)}
    assert p.bundles[-2:] == [{"CPU": 3.0}, {"CPU": 3.0}]
