"""Devices and number formats, without a GPU: the settings a CUDA worker would hand vLLM
and torch (checked as data), and the real CPU trainer path in float32, bfloat16 autocast
and pure bfloat16."""

import random

import pytest
import torch

from train_batches import TrainSample, micro_batch

from flexmarl.controller.tasks import digit_chain
from flexmarl.runtime import protocol as p
from flexmarl.workers import models, precision
from flexmarl.workers.precision import TrainPlacement, engine_args
from flexmarl.workers.trainer.worker import TrainerHandler


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build_model(digit_chain.AGENTS["planner"], digit_chain.VOCAB,
                              tmp_path_factory.mktemp("planner"))


def test_auto_dtype_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert precision.resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert precision.resolve_dtype("auto", "cpu") == "float32"
    assert precision.resolve_dtype("float16", "cuda:0") == "float16"


def test_a_cuda_engine_gets_the_agents_dtype_memory_share_and_parallelism():
    args = engine_args("cuda:0", p.EngineSettings("auto", 0.5, 2), 0, 256 << 20)
    assert args["dtype"] == "bfloat16"
    assert args["gpu_memory_utilization"] == 0.5 and args["tensor_parallel_size"] == 2
    assert args["distributed_executor_backend"] == "mp"  # one process per GPU of the engine
    assert args["max_model_len"] is None  # 0: the model's own context length
    assert "kv_cache_memory_bytes" not in args  # vLLM sizes the cache from the memory share
    one_gpu = engine_args("cuda:0", p.EngineSettings("float32", 0.9, 1), 4096, 256 << 20)
    assert one_gpu["distributed_executor_backend"] == "uni" and one_gpu["max_model_len"] == 4096


def test_engines_on_one_gpu_split_its_share_and_each_leaves_room_for_a_weight_receive():
    gib = 2**30
    # Alone on an 80 GiB GPU, a 3 GiB model: 0.9 less the receive bucket's share.
    assert precision.engine_memory_share(0.9, 1, 3 * gib, 80 * gib) == pytest.approx(0.9 - 3 / 80)
    # Two unpinned engines on one GPU: 0.45 each before the bucket, never 0.9 each.
    assert precision.engine_memory_share(0.9, 2, 3 * gib, 80 * gib) == pytest.approx(0.45 - 3 / 80)
    assert precision.engine_memory_share(0.9, 2, 0, 0) == pytest.approx(0.45)  # no NVML: nothing set aside
    with pytest.raises(ValueError, match=r"split between 16 engines on one GPU.*cluster.rollout_gpus"):
        precision.engine_memory_share(0.9, 16, 3 * gib, 80 * gib)
    args = engine_args("cuda:0", p.EngineSettings("auto", 0.9, 1, engines_on_gpu=3), 0, 256 << 20, 2 * gib, 80 * gib)
    assert args["gpu_memory_utilization"] == pytest.approx(0.3 - 2 / 80)


def test_a_cpu_engine_keeps_its_fixed_kv_cache_and_64_token_default_length():
    args = engine_args("cpu", p.EngineSettings(), 0, 256 << 20)
    assert args["dtype"] == "float32" and args["max_model_len"] == 64
    assert args["kv_cache_memory_bytes"] == 256 << 20 and "gpu_memory_utilization" not in args
    assert args["tensor_parallel_size"] == 1 and args["distributed_executor_backend"] == "uni"


def test_a_cpu_engine_of_several_ranks_runs_a_process_per_rank_each_bound_to_its_own_cores(monkeypatch):
    from flexmarl.workers.precision import engine_env

    args = engine_args("cpu", p.EngineSettings(tensor_parallel_size=2), 0, 1)
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "mp"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert engine_env("cpu", p.EngineSettings(tensor_parallel_size=2), threads=1) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert engine_env("cpu", p.EngineSettings(tensor_parallel_size=2), threads=8) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert engine_env("cpu", p.EngineSettings(), threads=1) == {} and engine_env("cuda:0", p.EngineSettings(tensor_parallel_size=2)) == {}
    with pytest.raises(ValueError, match="tensor_parallel_size 8 on the CPU needs a core per rank"):
        engine_env("cpu", p.EngineSettings(tensor_parallel_size=8))


def refuse(name):
    def called(*args, **kwargs):
        raise AssertionError(f"{name} initialises CUDA in the worker; vLLM's forked workers could not use it")
    return called


def test_a_worker_counts_its_gpus_without_initialising_cuda(monkeypatch):
    """torch.cuda.is_available() asks the CUDA runtime, which initialises the driver in the
    worker; vLLM then forks tensor-parallel workers that cannot use CUDA. device_count()
    asks NVML."""
    monkeypatch.setattr(torch.cuda, "is_available", refuse("torch.cuda.is_available"))
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", refuse("the CUDA runtime's device count"), raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert precision.worker_device() == "cuda:0"
    assert precision.visible_devices() == (["cuda:0"], [])


def test_a_worker_with_cuda_computes_on_its_first_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", refuse("torch.cuda.is_available"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert precision.worker_device() == "cuda:0"
    assert precision.visible_devices() == (["cuda:0", "cuda:1"], ["2", "3"])
    placement = TrainPlacement.resolve(p.TrainerSettings())
    assert placement.device == torch.device("cuda:0")
    # mixed: float32 master weights and optimizer state, bfloat16 forward and backward
    assert placement.param_dtype == torch.float32 and placement.compute_dtype == torch.bfloat16
    assert placement.autocasts


def test_a_worker_without_cuda_trains_in_float32_on_the_cpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert precision.visible_devices() == (["cpu"], [])
    placement = TrainPlacement.resolve(p.TrainerSettings())
    assert placement.device == torch.device("cpu") and placement.compute_dtype == torch.float32
    assert not placement.autocasts


def batch(version, n=4):
    rng = random.Random(version)
    return [TrainSample(f"s{i}", digit_chain.planner_prompt(digit_chain.make_query(rng)),
                          digit_chain.make_query(rng), rng.uniform(-1, 1), [], [version - 1]) for i in range(n)]


def train_once(model_dir, settings):
    h = TrainerHandler()
    h._execute(p.InitAgent(1, "planner", str(model_dir), 1e-3, 0, 1.0, settings))
    state = h.agents["planner"]
    seen = []
    hook = state.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    h._execute(micro_batch(2, "planner", 1, batch(1)))
    h._execute(p.OptimStep(3, "planner", 1, samples=4))
    hook.remove()
    return h, state, seen


def test_mixed_bfloat16_trains_over_float32_weights_and_optimizer_state_on_the_cpu(model_dir):
    h, state, seen = train_once(model_dir, p.TrainerSettings("bfloat16", "mixed", activation_checkpointing=True))
    assert set(seen) == {torch.bfloat16}  # every forward pass ran in bfloat16 ...
    assert all(q.dtype == torch.float32 for q in state.model.parameters())  # ... over float32 weights
    assert all(v.dtype == torch.float32 for s in state.optimizer.state.values() for k, v in s.items() if k != "step")
    assert state.model.is_gradient_checkpointing
    assert state.version == 1
    h.close()


def test_pure_bfloat16_keeps_weights_and_optimizer_state_in_bfloat16(model_dir):
    h, state, seen = train_once(model_dir, p.TrainerSettings("bfloat16", "pure"))
    assert set(seen) == {torch.bfloat16} and not state.model.is_gradient_checkpointing
    assert all(q.dtype == torch.bfloat16 for q in state.model.parameters())
    assert all(v.dtype == torch.bfloat16 for s in state.optimizer.state.values() for k, v in s.items() if k != "step")
    h.close()


def test_auto_on_the_cpu_is_todays_float32_training(model_dir):
    h, state, seen = train_once(model_dir, p.TrainerSettings())
    assert set(seen) == {torch.float32} and state.placement.device == torch.device("cpu")
    h.close()


def test_pure_float16_training_is_refused_because_adams_eps_is_zero_in_float16():
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0  # the arithmetic behind the refusal
    with pytest.raises(ValueError, match="pure float16 training is refused.*bfloat16"):
        TrainPlacement.resolve(p.TrainerSettings("float16", "pure"), "cpu")
    mixed = TrainPlacement.resolve(p.TrainerSettings("float16", "mixed"), "cpu")
    assert mixed.param_dtype == torch.float32 and mixed.compute_dtype == torch.float16


@pytest.mark.parametrize("settings, dtype", [(p.TrainerSettings("bfloat16", "mixed"), "bfloat16"),
                                             (p.TrainerSettings("bfloat16", "pure"), "bfloat16"),
                                             (p.TrainerSettings(), "float32")])
def test_weights_are_published_in_the_dtype_the_model_computes_in(model_dir, settings, dtype):
    """Mixed precision keeps float32 master weights, but the engine serves in the compute
    dtype: publishing float32 would move (and make the engine hold) twice the bytes."""
    h, state, _ = train_once(model_dir, settings)
    published = h._execute(p.PublishWeights(4, "planner", 1, "shm"))
    assert {spec.dtype for spec in published.handle.layout} == {dtype}
    elements = sum(q.numel() for q in state.model.parameters())
    assert published.nbytes >= elements * (2 if dtype == "bfloat16" else 4)
    assert published.nbytes < elements * (2 if dtype == "bfloat16" else 4) + 4096 * len(published.handle.layout)
    h.close()


def test_a_swapped_state_comes_back_with_the_agents_precision(model_dir):
    h, state, _ = train_once(model_dir, p.TrainerSettings("bfloat16", "pure"))
    out = h._execute(p.OffloadAgent(4, "planner"))
    other = TrainerHandler()
    other._execute(p.LoadAgent(5, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle,
                               p.TrainerSettings("bfloat16", "pure")))
    moved = other.agents["planner"]
    assert moved.placement.param_dtype == torch.bfloat16
    assert all(q.dtype == torch.bfloat16 for q in moved.model.parameters())
    h._execute(p.ReleaseState(6, "planner", out.handle))
    h.close(), other.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_trainer_step_runs_on_cuda_in_bfloat16(model_dir):
    h, state, seen = train_once(model_dir, p.TrainerSettings())  # auto: bfloat16 mixed on CUDA
    assert set(seen) == {torch.bfloat16}
    assert all(q.device.type == "cuda" and q.dtype == torch.float32 for q in state.model.parameters())
    assert all(v.device.type == "cuda" for s in state.optimizer.state.values() for k, v in s.items() if k != "step")
    published = h._execute(p.PublishWeights(4, "planner", 1, "shm"))
    assert published.version == 1
    h.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_rollout_engine_runs_on_cuda_in_bfloat16_within_its_memory_share(model_dir):
    pytest.importorskip("vllm")  # a GPU machine without vLLM runs the other gpu tests
    from flexmarl.workers.rollout.engine import VllmEngine

    engine = VllmEngine(model_dir, max_model_len=0, settings=p.EngineSettings(gpu_memory_utilization=0.3))
    try:
        config = engine._engine.vllm_config
        assert engine.device == "cuda:0" and config.model_config.dtype == torch.bfloat16
        assert config.cache_config.gpu_memory_utilization == 0.3
        engine.add("r", digit_chain.planner_prompt(digit_chain.make_query(random.Random(0))), 3, 1.0, 0)
        done = []
        while engine.has_unfinished():
            done += engine.step()
        assert len(done) == 1 and len(done[0].token_ids) >= 1
    finally:
        engine.close()
