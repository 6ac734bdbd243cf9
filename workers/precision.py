"""Where a worker computes and in what number format.

A worker learns its device from its own process: CUDA when torch sees a GPU (the launcher
pins each worker with CUDA_VISIBLE_DEVICES, so its first GPU is always `cuda:0`), else the
CPU. The controller sends per-agent settings (`protocol.EngineSettings`,
`protocol.TrainerSettings`) with "auto" left for the worker to resolve here:
bfloat16 on CUDA, float32 on CPU.

- `engine_args`: the device-dependent keyword arguments of `vllm.LLM`, one entry per
  device type in ENGINE_ARGS.
- `TrainPlacement`: a trainer's device, the dtype its weights are stored in, the dtype it
  computes in, and the autocast that bridges the two ("mixed": float32 weights and optimizer
  state, bfloat16 forward/backward; "pure": everything in the dtype).

It knows torch and the settings structs; nothing of agents, commands or the wire.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flexmarl.runtime.config import PURE_FLOAT16_WHY
from flexmarl.runtime.protocol import EngineSettings, TrainerSettings

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
AUTO_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}  # by device type

# Tiny models on CPU: a fixed context and KV cache. vLLM's CPU default claims a share of
# all host memory, far more than these models need, and 64 tokens fit every built-in task.
CPU_MAX_MODEL_LEN = 64


def cuda_device_count() -> int:
    """The GPUs this process sees, counted without initialising CUDA in it.

    torch.cuda.device_count() asks NVML (falling back to the CUDA runtime only where NVML
    is missing); torch.cuda.is_available() asks the CUDA runtime, which initialises the
    driver in this process, and a process that has done so cannot fork children that use
    CUDA: vLLM forks its tensor-parallel workers after the worker process has started."""
    return torch.cuda.device_count()


def worker_device() -> str:
    """This process's compute device: its first visible GPU, or the CPU."""
    return "cuda:0" if cuda_device_count() > 0 else "cpu"


def visible_devices() -> tuple[list[str], list[str]]:
    """What a worker reports in HELLO: the torch devices it can compute on, and the GPUs it
    was pinned to (its CUDA_VISIBLE_DEVICES entries; empty when it was not pinned)."""
    pinned = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    count = cuda_device_count()
    if count > 0:
        return [f"cuda:{i}" for i in range(count)], pinned
    return ["cpu"], pinned


def resolve_dtype(dtype: str, device: str) -> str:
    """A concrete dtype name for `device`: "auto" becomes bfloat16 on CUDA, float32 on CPU."""
    kind = torch.device(device).type
    if dtype == "auto":
        return AUTO_DTYPE.get(kind, "float32")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return dtype


# ---------------------------------------------------------------- rollout engines


def _cpu_engine_args(settings: EngineSettings, max_model_len: int, kv_cache_bytes: int,
                     receive_bytes: int = 0, gpu_bytes: int = 0) -> dict[str, Any]:
    tp = settings.tensor_parallel_size
    length = max_model_len or CPU_MAX_MODEL_LEN
    return dict(
        dtype=resolve_dtype(settings.dtype, "cpu"),
        max_model_len=length,
        # Explicit bytes: without them the CPU backend claims a fraction of all host
        # memory (or VLLM_CPU_KVCACHE_SPACE GiB), far more than tiny models need.
        kv_cache_memory_bytes=kv_cache_bytes,
        # Never split a prompt across steps: on CPU, seeded sampling of a request whose
        # prefill was chunked fails ("CPU Generator does not use offset"). A whole round
        # of requests fits one step's token budget at these sizes.
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(16384, length),
        tensor_parallel_size=tp,
        # One rank: the engine in this process; several: vLLM starts a process per rank,
        # each bound to its own cores (engine_env).
        distributed_executor_backend="uni" if tp == 1 else "mp",
    )


def engine_env(device: str, settings: EngineSettings, threads: int | None = None) -> dict[str, str]:
    """Environment vLLM reads as it starts an engine's workers. A CPU engine of several
    ranks binds each rank's threads to cores of its own: vLLM's automatic binding wants a
    NUMA node per rank, which a one-socket host does not have. Each rank gets `threads`
    cores (default: this process's torch threads), as many as the cores allow."""
    tp = settings.tensor_parallel_size
    if torch.device(device).type != "cpu" or tp == 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"tensor_parallel_size {tp} on the CPU needs a core per rank; this process may use "
                         f"{len(cpus)} ({', '.join(map(str, cpus))})")
    per = max(1, min(len(cpus) // tp, threads or torch.get_num_threads()))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cpus[r * per:(r + 1) * per])) for r in range(tp))}


# The least share of its GPU an engine is started with: below it the weights and a useful
# KV cache of any model worth serving on a GPU do not fit.
MIN_ENGINE_SHARE = 0.05


def engine_memory_share(requested: float, engines_on_gpu: int, receive_bytes: int, gpu_bytes: int) -> float:
    """The share of its GPU one engine asks vLLM for. The agent's share (what the config
    asks of a GPU) is split between the engines placed on that GPU, and each leaves room
    for a weight receive beside it: an NCCL broadcast lands in a bucket of the model's
    bytes on the engine's GPU, which vLLM, holding its share, would not leave free."""
    if engines_on_gpu < 1:
        raise ValueError(f"engines_on_gpu must be >= 1, got {engines_on_gpu}")
    share = requested / engines_on_gpu - (receive_bytes / gpu_bytes if gpu_bytes > 0 else 0.0)
    if share < MIN_ENGINE_SHARE:
        raise ValueError(
            f"a rollout engine would get {share:.3f} of its GPU: gpu_memory_utilization {requested} split between "
            f"{engines_on_gpu} engines on one GPU, less {receive_bytes / 2**30:.2f} GiB for receiving the weights "
            f"(of {gpu_bytes / 2**30:.1f} GiB); pin rollout workers to GPUs of their own (cluster.rollout_gpus), "
            "run fewer on each GPU, or raise gpu_memory_utilization")
    return share


def _cuda_engine_args(settings: EngineSettings, max_model_len: int, kv_cache_bytes: int,
                      receive_bytes: int = 0, gpu_bytes: int = 0) -> dict[str, Any]:
    tp = settings.tensor_parallel_size
    share = engine_memory_share(settings.gpu_memory_utilization, settings.engines_on_gpu, receive_bytes, gpu_bytes)
    return dict(
        dtype=resolve_dtype(settings.dtype, "cuda"),
        max_model_len=max_model_len or None,  # None: the model's own context length
        # The KV cache takes what the share leaves after the weights: vLLM sizes it.
        gpu_memory_utilization=share,
        tensor_parallel_size=tp,
        # One GPU: the engine in this process; several: vLLM starts one process per GPU.
        distributed_executor_backend="uni" if tp == 1 else "mp",
    )


ENGINE_ARGS: dict[str, Callable[..., dict[str, Any]]] = {
    "cpu": _cpu_engine_args,
    "cuda": _cuda_engine_args,
}


def engine_args(device: str, settings: EngineSettings, max_model_len: int, kv_cache_bytes: int,
                receive_bytes: int = 0, gpu_bytes: int = 0) -> dict[str, Any]:
    """The device-dependent arguments of `vllm.LLM` for an engine on `device`; on CUDA,
    `receive_bytes` (a weight receive's bucket) of the GPU's `gpu_bytes` are left free. An
    engine that serves adapters gets its LoRA slots too (the same on every device)."""
    kind = torch.device(device).type
    if kind not in ENGINE_ARGS:
        raise ValueError(f"no rollout engine settings for device {device!r} (known: {', '.join(ENGINE_ARGS)})")
    block = {"block_size": settings.block_size} if settings.block_size else {}
    return ENGINE_ARGS[kind](settings, max_model_len, kv_cache_bytes, receive_bytes, gpu_bytes) | lora_args(settings) | block


def lora_args(settings: EngineSettings) -> dict[str, Any]:
    """vLLM's LoRA arguments for an engine with adapter slots; none without."""
    if not settings.max_loras:
        return {}
    return dict(enable_lora=True, max_loras=settings.max_loras, max_lora_rank=settings.max_lora_rank or 16,
                max_cpu_loras=max(settings.max_cpu_loras, settings.max_loras))


def gpu_total_bytes(index: int = 0) -> int:
    """The memory of this process's GPU `index`, asked of NVML (as the host numbers GPUs,
    hence through CUDA_VISIBLE_DEVICES), so that CUDA is not initialised; 0 if NVML cannot
    say (then no room is set aside)."""
    try:
        import pynvml
    except ImportError:
        return 0
    from flexmarl.runtime.params.types import host_device

    pinned = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    name = host_device(f"cuda:{index}", pinned).partition(":")[2]
    try:
        pynvml.nvmlInit()
        try:
            handle = (pynvml.nvmlDeviceGetHandleByUUID(name) if name.startswith(("GPU-", "MIG-"))
                      else pynvml.nvmlDeviceGetHandleByIndex(int(name)))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML here: the share is used as given
        return 0


# ---------------------------------------------------------------- trainers


@dataclass(frozen=True)
class TrainPlacement:
    device: torch.device
    compute_dtype: torch.dtype  # what forward and backward run in
    param_dtype: torch.dtype  # what weights, gradients and optimizer state are stored in
    activation_checkpointing: bool = False
    compile_layers: bool = False  # torch.compile each norm and MLP module (compile_layers below)
    # What the weights are published in, for engines to serve: the compute dtype, unless
    # set (a trainer group computes through FSDP's own casts and says it here).
    serve_dtype: torch.dtype | None = None

    @classmethod
    def resolve(cls, settings: TrainerSettings, device: str | None = None) -> TrainPlacement:
        device = device or worker_device()
        compute = DTYPES[resolve_dtype(settings.dtype, device)]
        stored = torch.float32 if settings.precision == "mixed" else compute
        if stored == torch.float16:
            raise ValueError(f"pure float16 training is refused: {PURE_FLOAT16_WHY}")
        return cls(torch.device(device), compute, stored, settings.activation_checkpointing,
                   compile_layers=settings.compile_layers)

    @property
    def publish_dtype(self) -> torch.dtype:
        """Mixed precision keeps float32 master weights, but the model computes (and the
        engine serves) in the lower dtype: publishing float32 would move twice the bytes
        an engine needs, and make every process on the way hold them."""
        return self.serve_dtype or self.compute_dtype

    @property
    def autocasts(self) -> bool:
        return self.compute_dtype != self.param_dtype

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass (and the loss) runs in: lower-precision matmuls
        over float32 master weights when mixed, nothing otherwise."""
        if not self.autocasts:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def prepare(self, model: Any) -> Any:
        """A freshly built model moved to the device, in training mode, with activation
        checkpointing if asked for. Gradients and optimizer state move with `move_state`."""
        model.to(self.device)
        if self.compile_layers:
            compile_layers(model)
        if self.activation_checkpointing:
            # Non-reentrant: works with inputs that need no grad and with autocast.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model

    def move_state(self, optimizer: Any) -> None:
        """Optimizer state onto the device (after a state was received in host memory).
        Step counters stay where torch's own optimizers keep them, on the CPU."""
        for state in optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(self.device)


# Module classes whose work is elementwise and memory-bound in eager mode, by name suffix:
# transformers' RMSNorm and gated MLP classes of every decoder (Qwen2RMSNorm, LlamaMLP, ...).
COMPILED_SUFFIXES = ("RMSNorm", "MLP")


def compile_layers(model: Any) -> int:
    """torch.compile (dynamic shapes: a packed micro-batch's length changes every call)
    each norm and MLP module of `model` in place; returns how many. Their eager kernels,
    one per elementwise op in float32 under mixed precision, are most of a GPU step's
    time beside the matmuls; compiled, each module's elementwise work is fused. Attention
    (its own kernels) and the head (chunked, scoring.py) are left as they are."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith(COMPILED_SUFFIXES):
            module.compile(dynamic=True)
            count += 1
    return count
