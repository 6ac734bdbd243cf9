"""The GPU check: what FlexMARL does on a CUDA machine, at the sizes users train, in one command.

    bash scripts/gpu_check.sh [--shapes qwen2.5-0.5b,qwen2.5-1.5b,llama3.2-1b] [--out FILE]
    python scripts/gpu_check.py --dry-run          # CPU: tiny shapes, CUDA-only parts skipped

Models are built from configs (random weights, the real shapes and vocabularies) and saved
once under a temporary directory; every part then runs FlexMARL's own code:

- gpu_tests: the gpu-marked tests of the suite (pytest -m gpu).
- train: the trainer's INIT_AGENT, TRAIN_MICROBATCH and OPTIM_STEP (TrainerHandler) per
  shape, in bf16 "mixed" (float32 master weights) and "pure" precision, with activation
  checkpointing off and on: tokens/s over the timed iterations and peak GPU memory.
- cuda_ipc: the trainer publishes an agent's weights over CUDA IPC (PUBLISH_WEIGHTS), sync
  after sync; a second process on the same GPU receives each into a model's own tensors.
  The first sync (which maps the publisher's bucket) and the later ones (which find it
  mapped) are reported apart, each against a device-to-device copy of the same bytes,
  with a digest of every tensor compared on both sides. The dry run makes the same
  syncs over shm.
- park: OFFLOAD_AGENT of a GPU training state with a step in progress, then LOAD_AGENT on
  the same trainer (it takes back what it kept) and, parked again, on another trainer;
  every tensor of the state compared byte for byte each time.
- mfu: the trainer's FLOP/s as a share of a plain bf16 matmul's (bench/micro/trainer_throughput.py:
  FLOPs counted from the tokens trained, attention included) on long-tailed GRPO
  micro-batches of about 4,096 and 16,384 tokens, at the Qwen2.5-1.5B shape (target
  MFU_TARGET), with its peak memory.
- lora: four agents as LoRA adapters of one base on one trainer (the base held once): a
  micro-batch and step each (tokens/s, peak memory), a publish of one adapter (its bytes),
  and a park and restore of one adapter with its optimizer state, byte for byte.
- fsdp2: a one-rank trainer group (TrainerGroupHandler: FSDP2 on NCCL) against the plain
  trainer from the same weights and samples.
- nccl_setup: a CuPy NCCL communicator (the parameter channel's CupyCommunicator) made,
  used for a one-rank broadcast and destroyed.
- The parts that need vLLM are listed as not run, with the reason.

Prints one JSON row per measurement, then a short table; exits 1 if any part failed or
any comparison did not match. The dry run (--dry-run) does the same on the CPU with tiny
shapes and reports the CUDA-only parts as skipped: the test suite runs it, so this script
does not rot between loans of a GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import msgspec  # noqa: E402
import torch  # noqa: E402

from flexmarl.runtime import protocol  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The benches this check runs and the shapes it shares with them live in bench/micro/.
sys.path.insert(0, str(ROOT / "bench" / "micro"))
from real_shapes import LR, SHAPES, Trainer, build_model, samples, sync  # noqa: E402

NOT_RUN = {
    "vllm_engine": "vLLM is not installed on the GPU machine (its wheel is larger than what a call can carry): "
                   "engine start, LoadWeights into a CUDA engine and CUDA rollout settings wait for a machine with it",
    "nccl_two_ranks": "one GPU: NCCL refuses two ranks on one device, so a broadcast between a trainer and an "
                      "instance on other GPUs needs a machine with two",
}

ROWS: list[dict] = []
MFU_SHAPE, MFU_TARGET = "qwen2.5-1.5b", 0.4  # the trainer's share of the matmul rate it should reach


def emit(row: dict) -> dict:
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def failed(row: dict, exc: BaseException) -> dict:
    return emit({**row, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc(limit=6)})


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


# ------------------------------------------------------------------------- parts


def run_gpu_tests(args) -> None:
    if args.dry_run:
        emit({"part": "gpu_tests", "ok": True, "skipped": "dry run: the gpu-marked tests need CUDA"})
        return
    # Only the files that hold gpu-marked tests: the others import vLLM, which a GPU machine
    # without it cannot collect.
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.tests_timeout)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-300:]
    emit({"part": "gpu_tests", "ok": proc.returncode == 0, "summary": summary, "seconds": time.perf_counter() - t0,
          **({} if proc.returncode == 0 else {"output": proc.stdout[-4000:] + proc.stderr[-2000:]})})


def run_train(args, shape: str, path: Path, device: torch.device) -> None:
    vocab = SHAPES[shape]["vocab_size"]
    batch = samples(args.batch, args.prompt_len, args.output_len, vocab, seed=1)
    tokens = args.batch * (args.prompt_len + args.output_len)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    for precision in ("mixed", "pure"):
        for checkpointing in (False, True):
            row = {"part": "train", "shape": shape, "precision": precision, "dtype": dtype,
                   "activation_checkpointing": checkpointing, "tokens_per_iteration": tokens}
            trainer = Trainer()
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                settings = protocol.TrainerSettings(dtype=dtype, precision=precision,
                                                    activation_checkpointing=checkpointing)
                ready = trainer.init("a", path, settings)
                trainer.iteration("a", 1, batch)  # warm-up: kernels, allocator, optimizer state
                sync(device)
                t0 = time.perf_counter()
                for v in range(2, 2 + args.iterations):
                    done = trainer.iteration("a", v, batch)
                sync(device)
                seconds = (time.perf_counter() - t0) / args.iterations
                finite = all(torch.isfinite(p).all() for p in trainer.handler.agents["a"].model.parameters())
                emit({**row, "ok": bool(finite), "parameters": ready.num_params, "seconds_per_iteration": seconds,
                      "tokens_per_s": tokens / seconds, "peak_gib": peak_gib(device), "loss": done.stats.loss,
                      "grad_norm": done.grad_norm, **({} if finite else {"error": "non-finite weights after a step"})})
            except Exception as exc:  # noqa: BLE001 - one failed combination is reported, the others still run
                failed(row, exc)
            finally:
                trainer.close()
                del trainer


def run_mfu(args, shape: str, path: Path, device: torch.device) -> None:
    from trainer_throughput import measure, rates

    budgets = [256] if args.dry_run else [4096, 16384]
    for tokens in budgets:
        row = {"part": "mfu", "shape": shape, "budget_tokens": tokens, "target": MFU_TARGET}
        try:
            got = rates(measure(shape, str(path), str(device), tokens, checkpointing=False, group_size=4,
                                seed=tokens, reps=1 if args.dry_run else 3,
                                matmul_size=256 if args.dry_run else 8192))
            emit({**row, **got, "meets_target": got.get("of_matmul", 0.0) >= MFU_TARGET})
        except Exception as exc:  # noqa: BLE001
            failed(row, exc)


RECEIVER = r"""
import json, sys, time, msgspec, torch
from flexmarl.runtime.params.channel import Location, ParamChannel, ParamHandle, torch_dtype
device = torch.device(sys.argv[1])
dst = None
with ParamChannel(location=Location.here(str(device))) as channel:
    for line in sys.stdin:  # one publication per line, in the order a run's syncs come
        handle = msgspec.msgpack.decode(bytes.fromhex(line), type=ParamHandle)
        if dst is None:  # the model's own tensors, made once
            dst = {s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in handle.layout}
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        channel.receive_into(handle, dst)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        channel.release(handle)
        digest = {k: float(v.double().sum()) for k, v in dst.items()}
        print(json.dumps({"seconds": seconds, "digest": digest}), flush=True)
"""


def run_cuda_ipc(args, shape: str, path: Path, device: torch.device) -> None:
    """Weight syncs as a run makes them: the trainer publishes a version (PUBLISH_WEIGHTS),
    a receiver in another process copies it into a model's own tensors, then the next
    version (each publication released before the next, its allocation reused). The first
    receive maps the publisher's bucket; the later ones find it mapped: they are reported
    apart, each against a copy of the same bytes on the device. On the CPU (the dry run)
    the same sequence runs over shm."""
    transport = "cuda_ipc" if device.type == "cuda" else "shm"
    row = {"part": "cuda_ipc", "shape": shape, "transport": transport}
    trainer = Trainer()
    receiver = None
    try:
        trainer.init("a", path, protocol.TrainerSettings(dtype="bfloat16" if device.type == "cuda" else "float32",
                                                         precision="mixed" if device.type == "cuda" else "pure"))
        receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(device)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, cwd=ROOT)
        publish_s, receives, mismatched, handle = [], [], [], None
        params = dict(trainer.handler.agents["a"].model.named_parameters())
        for sync_number in range(args.syncs):
            sync(device)
            t0 = time.perf_counter()
            handle = trainer(protocol.PublishWeights, agent="a", version=0, transport=transport, targets=["r"]).handle
            sync(device)
            publish_s.append(time.perf_counter() - t0)
            receiver.stdin.write(msgspec.msgpack.encode(handle).hex() + "\n")
            receiver.stdin.flush()
            line = receiver.stdout.readline()
            if not line:
                raise RuntimeError(f"the receiver exited {receiver.wait(60)} at sync {sync_number + 1}")
            got = json.loads(line)
            receives.append(got["seconds"])
            want = {k: float(params[k].detach().to(getattr(torch, spec_dtype(handle, k))).double().sum())
                    for k in got["digest"]}
            mismatched += [k for k in want if want[k] != got["digest"][k]]
        copy_s = device_copy_s(handle.total_bytes, device)
        first, later = receives[0], statistics.median(receives[1:])
        gb = handle.total_bytes / 1e9
        emit({**row, "ok": not mismatched, "bytes": handle.total_bytes,
              "dtypes": sorted({spec.dtype for spec in handle.layout}), "syncs": args.syncs,
              "publish_s": statistics.median(publish_s), "first_receive_s": first, "later_receive_s": later,
              "receive_s_each": receives, "first_gb_per_s": gb / first, "later_gb_per_s": gb / later,
              "copy_gb_per_s": gb / copy_s, "first_vs_copy": copy_s / first, "later_vs_copy": copy_s / later,
              **({"mismatched": sorted(set(mismatched))[:5]} if mismatched else {})})
    except Exception as exc:  # noqa: BLE001
        failed(row, exc)
    finally:
        if receiver is not None:
            receiver.stdin.close()
            receiver.wait(60)
        trainer.close()


def device_copy_s(nbytes: int, device: torch.device) -> float:
    """The median of five copies of `nbytes` between two buffers on `device`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        copies.append(time.perf_counter() - t0)
    return statistics.median(copies)


ENGINE_WORKER = r"""
import json, sys, time, types, msgspec, torch
from transformers import AutoModelForCausalLM
from flexmarl.runtime.params.channel import ParamHandle
from flexmarl.workers.rollout.engine_receive import PublishedLoad, WeightReceiver
handle = msgspec.msgpack.decode(bytes.fromhex(sys.stdin.readline()), type=ParamHandle)
model_path, device = sys.argv[1], sys.argv[2]

class Worker(WeightReceiver):
    # vLLM's worker as the extension sees it (no vLLM here): a rank, a model, a reload.
    rank = 0
    def __init__(self):
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device)
        self.model_runner = types.SimpleNamespace(get_model=lambda: self.model)
    def reload_weights(self, weights_iterator, is_checkpoint_format):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in weights_iterator:
                params[name].copy_(t)

worker = Worker()
# tied=False: the stand-in's model is transformers', whose tied head follows its embedding
request = msgspec.msgpack.encode(PublishedLoad(handle=handle, tied=False, inplace=False))
t0 = time.perf_counter()
received = worker.flexmarl_receive(request)
applied = worker.flexmarl_apply(handle.key) if received.ok else received
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
digest = {k: float(v.detach().double().sum()) for k, v in worker.model.named_parameters()}
print(json.dumps({"received": msgspec.to_builtins(received), "applied": msgspec.to_builtins(applied),
                  "seconds": seconds,
                  "request_bytes": len(request), "digest": digest}), flush=True)
"""


def run_engine_receive(args, shape: str, path: Path, device: torch.device) -> None:
    """What a vLLM engine's worker runs to load published weights (engine_receive.py),
    in a process of its own with a stand-in for vLLM's worker around a real model on the
    device: it maps the trainer's publication (CUDA IPC on a GPU, found by the GPU's UUID;
    shm on the CPU) and loads it; the weights must arrive byte-exact."""
    row = {"part": "engine_receive", "shape": shape}
    trainer = Trainer()
    transport = "cuda_ipc" if device.type == "cuda" else "shm"
    try:
        trainer.init("a", path, protocol.TrainerSettings(dtype="bfloat16", precision="mixed"))
        published = trainer(protocol.PublishWeights, agent="a", version=0, transport=transport, targets=["r"])
        handle = published.handle
        proc = subprocess.run([sys.executable, "-c", ENGINE_WORKER, str(path), str(device)],
                              input=msgspec.msgpack.encode(handle).hex() + "\n", capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"engine worker exited {proc.returncode}: {proc.stderr[-2000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        params = dict(trainer.handler.agents["a"].model.named_parameters())
        want = {k: float(params[k].detach().to(torch.bfloat16).double().sum()) for k in params}
        mismatched = [k for k in want if want[k] != got["digest"].get(k)]
        ok = got["received"][0] and got["applied"][0] and not mismatched
        emit({**row, "ok": bool(ok), "transport": transport, "bytes": handle.total_bytes,
              "request_bytes": got["request_bytes"], "receive_and_load_s": got["seconds"],
              "gb_per_s": handle.total_bytes / 1e9 / got["seconds"],
              **({"error": " ".join(got["received"][1:] + got["applied"][1:])} if not ok and not mismatched else {}),
              **({"mismatched": mismatched[:5]} if mismatched else {})})
    except Exception as exc:  # noqa: BLE001
        failed(row, exc)
    finally:
        trainer.close()


def spec_dtype(handle, name: str) -> str:
    return next(s.dtype for s in handle.layout if s.name == name)


def run_park(args, shape: str, path: Path, device: torch.device) -> None:
    """OFFLOAD_AGENT of a training state with a step in progress, then LOAD_AGENT on the same
    trainer (it takes back the state it kept: on a GPU a copy to the device tensor by
    tensor) and, parked again, on another trainer (a copy from the parked bucket); every
    tensor of the state compared byte for byte each time."""
    from flexmarl.workers.trainer.worker import training_state

    row = {"part": "park", "shape": shape}
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    settings = protocol.TrainerSettings(dtype=dtype, precision="mixed")
    trainer, other = Trainer(), Trainer()

    def state_of(t: Trainer) -> dict[str, torch.Tensor]:
        state = t.handler.agents["a"]
        return {k: v.detach().to("cpu", copy=True) for k, v in
                training_state(state.model, state.optimizer, state.sums).items()}

    def load(t: Trainer, parked) -> float:
        t0 = time.perf_counter()
        t(protocol.LoadAgent, agent="a", model_path=str(path), lr=1e-5, max_grad_norm=1.0, version=parked.version,
          accumulated=parked.accumulated, handle=parked.handle, settings=settings)
        sync(device)
        return time.perf_counter() - t0

    try:
        trainer.init("a", path, settings)
        vocab = SHAPES[shape]["vocab_size"]
        trainer.iteration("a", 1, samples(2, 16, 16, vocab, seed=2))  # Adam state exists
        pending = samples(2, 16, 16, vocab, seed=3)
        for group in pending:
            group.versions = [1] * len(group.lengths)
        trainer(protocol.TrainMicroBatch, agent="a", version=2, groups=pending)
        before = state_of(trainer)
        sync(device)
        parked = trainer(protocol.OffloadAgent, agent="a", transport="shm")
        take_back_s = load(trainer, parked)
        back = state_of(trainer)
        on_device = {str(p.device) for p in trainer.handler.agents["a"].model.parameters()}
        again = trainer(protocol.OffloadAgent, agent="a", transport="shm")
        elsewhere_s = load(other, again)
        trainer(protocol.ReleaseState, agent="a", handle=again.handle)
        moved = state_of(other)
        differ = [k for k in before if any(k not in got or not _same_bytes(before[k], got[k]) for got in (back, moved))]
        differ += [k for got in (back, moved) for k in got if k not in before]
        emit({**row, "ok": not differ and parked.version == 1, "tensors": len(before), "bytes": parked.nbytes,
              "offload_s": parked.seconds, "take_back_s": take_back_s, "offload_again_s": again.seconds,
              "load_elsewhere_s": elsewhere_s, "devices_after": sorted(on_device),
              **({"differ": sorted(set(differ))[:5]} if differ else {})})
    except Exception as exc:  # noqa: BLE001
        failed(row, exc)
    finally:
        trainer.close()
        other.close()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def run_lora(args, shape: str, path: Path, device: torch.device, agents: int = 4) -> None:
    """Agents as LoRA adapters of one base on one trainer: the base held once, each agent's
    micro-batch and step on its own adapter, a publish that moves the adapter only, and a
    park and restore of one adapter with its optimizer state, byte for byte."""
    from flexmarl.workers.trainer.worker import training_state

    row = {"part": "lora", "shape": shape, "agents": agents}
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    settings = protocol.TrainerSettings(dtype=dtype, precision="mixed")
    lora = protocol.LoraSettings(rank=8, alpha=16.0)
    vocab = SHAPES[shape]["vocab_size"]
    batch = samples(args.batch, args.prompt_len, args.output_len, vocab, seed=5)
    trainer = Trainer()
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        names = [f"agent{i}" for i in range(agents)]
        for name in names:
            trainer(protocol.InitAgent, agent=name, model_path=str(path), lr=LR, seed=0, settings=settings, lora=lora)
        base = trainer.handler.agents[names[0]].model
        for name in names:  # warm-up: kernels and each adapter's optimizer state
            trainer.iteration(name, 1, batch)
        sync(device)
        t0 = time.perf_counter()
        for name in names:
            trainer.iteration(name, 2, batch)
        sync(device)
        seconds = (time.perf_counter() - t0) / agents
        published = trainer(protocol.PublishWeights, agent=names[0], version=2, transport="shm", targets=["r"])
        adapter_elements = sum(p.numel() for p in trainer.handler.agents[names[0]].model.parameters())
        state = trainer.handler.agents[names[-1]]
        pending = samples(2, 16, 16, vocab, seed=6)
        for group in pending:
            group.versions = [2] * len(group.lengths)
        trainer(protocol.TrainMicroBatch, agent=names[-1], version=3, groups=pending)
        before = {k: v.detach().to("cpu", copy=True) for k, v in
                  training_state(state.model, state.optimizer, state.sums).items()}
        parked = trainer(protocol.OffloadAgent, agent=names[-1], transport="shm")
        trainer(protocol.LoadAgent, agent=names[-1], model_path=str(path), lr=LR, max_grad_norm=1.0,
                version=parked.version, accumulated=parked.accumulated, handle=parked.handle, settings=settings,
                lora=lora)
        state = trainer.handler.agents[names[-1]]
        after = {k: v.detach().to("cpu") for k, v in training_state(state.model, state.optimizer, state.sums).items()}
        differ = sorted(k for k in before.keys() | after.keys()
                        if k not in before or k not in after or not _same_bytes(before[k], after[k]))
        one_base = len({id(trainer.handler.agents[n].model.base) for n in names}) == 1
        emit({**row, "ok": not differ and one_base, "one_base": one_base, "base_parameters": base.base.base_params, "tokens_per_s": len(batch) * (args.prompt_len + args.output_len) / seconds,
              "peak_gib": peak_gib(device), "adapter_parameters": adapter_elements,
              "publish_bytes": published.nbytes, "park_bytes": parked.nbytes, "park_tensors": len(before),
              **({"differ": differ[:5]} if differ else {})})
    except Exception as exc:  # noqa: BLE001
        failed(row, exc)
    finally:
        trainer.close()


def run_fsdp2(args, shape: str, path: Path, device: torch.device) -> None:
    row = {"part": "fsdp2", "shape": shape}
    if device.type != "cuda":
        emit({**row, "ok": True, "skipped": "needs CUDA (the CPU trainer group runs in the suite, on gloo)"})
        return
    from flexmarl.workers.trainer.group import TrainerGroupHandler

    vocab = SHAPES[shape]["vocab_size"]
    batch = samples(4, 32, 32, vocab, seed=4)
    settings = protocol.TrainerSettings(dtype="bfloat16", precision="mixed")
    plain, group = Trainer(), None
    try:
        plain.init("a", path, settings)
        plain.iteration("a", 1, batch)
        want = {k: v.detach().float().cpu() for k, v in plain.handler.agents["a"].model.named_parameters()}
        plain.close()
        t0 = time.perf_counter()
        group = Trainer(TrainerGroupHandler.start(1))
        formed_s = time.perf_counter() - t0
        group.init("a", path, settings)
        t0 = time.perf_counter()
        done = group.iteration("a", 1, batch)
        step_s = time.perf_counter() - t0
        # inproc: CUDA IPC cannot open a handle in the process that made it.
        published = group(protocol.PublishWeights, agent="a", version=1, transport="inproc", targets=["r"])
        from flexmarl.runtime.params.channel import ParamChannel
        with ParamChannel() as receiver:
            got = receiver.receive(published.handle)
            # One Adam step moves each weight by lr * m / (sqrt(v) + eps), about +-lr wherever
            # the gradient is not tiny. A gradient near zero whose sign a reordered reduction
            # flips moves its weight the other way: up to 2 lr apart. Both sides are compared
            # as served (the plain trainer's weights rounded to the group's dtype), where two
            # such values may land one unit in the last place further apart: 2^-7 of the
            # tensor's largest magnitude in bfloat16.
            worst, tolerance, ratio = 0.0, 0.0, 0.0
            for k in want:
                mine = want[k].to(got[k].dtype).float()
                diff = float((got[k].float().cpu() - mine).abs().max())
                ulp = float(want[k].abs().max()) * (2.0**-7 if got[k].dtype == torch.bfloat16 else 2.0**-23)
                bound = 2 * LR + ulp
                if diff / bound > ratio:
                    worst, tolerance, ratio = diff, bound, diff / bound
            del got
        dtypes = sorted({spec.dtype for spec in published.handle.layout})
        # Over CUDA IPC the bucket is CuPy's memory, outside torch's allocator: torch's peak
        # during the publish is what rank 0 gathered beside it. Streamed, one weight (its
        # bf16 shard cast and the gathered copy: at most two of the largest).
        largest = max(v.numel() for v in group.handler.agents["a"].model.parameters()) * 2
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
        group(protocol.PublishWeights, agent="a", version=1, transport="cuda_ipc", targets=["r"])
        gathered_peak = torch.cuda.max_memory_allocated(device) - held
        ok = (ratio <= 1.0 and done.version == 1 and dtypes == ["bfloat16"]  # served as computed
              and gathered_peak <= 2 * largest + (64 << 20))
        emit({**row, "ok": ok, "group_formed_s": formed_s, "step_s": step_s, "max_abs_diff_vs_plain": worst,
              "tolerance": tolerance, "published_bytes": published.handle.total_bytes, "published_dtypes": dtypes,
              "publish_gathered_peak_mb": gathered_peak / 2**20, "largest_weight_mb": largest / 2**20})
    except Exception as exc:  # noqa: BLE001
        failed(row, exc)
    finally:
        if group is not None:
            group.close()


FORK_CHILD = r"""
import os, sys, torch
from flexmarl.workers.precision import visible_devices
if sys.argv[1] == "is_available":
    torch.cuda.is_available()  # what workers/main.py did before: the CUDA runtime counts the GPUs
devices, _ = visible_devices()
pid = os.fork()  # as vLLM forks its tensor-parallel workers
if pid == 0:
    try:
        torch.ones(4, device="cuda").sum().item()
        os._exit(0)
    except BaseException as exc:
        print(f"child: {exc!r}"[:300], file=sys.stderr, flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
print(devices[0], os.waitstatus_to_exitcode(status))
"""


def run_fork_safe(args, device: torch.device) -> None:
    """A worker that counts its GPUs the way workers/main.py does can still fork children
    that use CUDA; the CUDA runtime's count (torch.cuda.is_available) is shown beside it."""
    row = {"part": "fork_safe"}
    if device.type != "cuda":
        emit({**row, "ok": True, "skipped": "needs CUDA"})
        return
    try:
        codes = {}
        for how in ("visible_devices", "is_available"):
            proc = subprocess.run([sys.executable, "-c", FORK_CHILD, how], capture_output=True, text=True,
                                  timeout=300, cwd=ROOT)
            codes[how] = proc.stdout.strip() or proc.stderr.strip()[-300:]
        ok = codes["visible_devices"].endswith(" 0")
        emit({**row, "ok": ok, "child_after_visible_devices": codes["visible_devices"],
              "child_after_is_available": codes["is_available"]})
    except Exception as exc:  # noqa: BLE001
        failed(row, exc)


def run_nccl_setup(args, device: torch.device) -> None:
    row = {"part": "nccl_setup"}
    if device.type != "cuda":
        emit({**row, "ok": True, "skipped": "needs CUDA and CuPy"})
        return
    try:
        from flexmarl.runtime.params import nccl as param_nccl
        from flexmarl.runtime.params.types import NcclInfo

        t0 = time.perf_counter()
        info = NcclInfo(param_nccl.new_unique_id(), 1, "check")
        comm = param_nccl.CupyCommunicator(info, 0, device)
        setup_s = time.perf_counter() - t0
        bucket = torch.arange(4096, dtype=torch.uint8, device=device)
        expect = bucket.clone()
        t0 = time.perf_counter()
        comm.broadcast(bucket)
        broadcast_s = time.perf_counter() - t0
        comm.close()
        # ncclCommAbort, what a receive that timed out does to its communicator
        aborted = param_nccl.CupyCommunicator(NcclInfo(param_nccl.new_unique_id(), 1, "abort"), 0, device)
        aborted.abort()
        emit({**row, "ok": torch.equal(bucket, expect), "setup_s": setup_s, "broadcast_s": broadcast_s,
              "abort": "ran"})
    except Exception as exc:  # noqa: BLE001
        failed(row, exc)


# ------------------------------------------------------------------------- main


def table(rows: list[dict]) -> str:
    lines = [f"{'part':<11} {'shape':<13} {'what':<34} {'figure':<38} ok"]
    for r in rows:
        what, figure = "", ""
        if r.get("skipped") or r.get("not_run"):
            figure = (r.get("skipped") or r.get("not_run"))[:38]
        elif r["part"] == "train" and "tokens_per_s" in r:
            what = f"{r['precision']} ckpt={'on' if r['activation_checkpointing'] else 'off'}"
            figure = f"{r['tokens_per_s']:,.0f} tok/s, peak {r['peak_gib']:.1f} GiB"
        elif r["part"] == "mfu" and "of_matmul" in r:
            what = f"{r['tokens']:,} tokens, {r['samples']} samples"
            figure = f"{r['of_matmul']:.2f} of matmul, peak {r['peak_gib']:.1f} GiB"
        elif r["part"] == "cuda_ipc" and "later_gb_per_s" in r:
            what = f"{r['transport']} {r['bytes'] / 1e9:.2f} GB {'/'.join(r['dtypes'])}"
            figure = f"1st {r['first_vs_copy']:.2f}, later {r['later_vs_copy']:.2f} of a copy"
        elif r["part"] == "engine_receive" and "gb_per_s" in r:
            what = f"{r['transport']} {r['bytes'] / 1e9:.2f} GB, call {r['request_bytes']} B"
            figure = f"{r['gb_per_s']:.1f} GB/s received and loaded"
        elif r["part"] == "park" and "bytes" in r:
            what = f"{r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB"
            figure = (f"off {r['offload_s']:.2f} back {r['take_back_s']:.2f} elsewhere {r['load_elsewhere_s']:.2f} s"
                      if r["ok"] else "MISMATCH")
        elif r["part"] == "lora" and "tokens_per_s" in r:
            what = f"{r['agents']} adapters, {r['adapter_parameters'] / 1e6:.1f}M params each"
            figure = f"{r['tokens_per_s']:,.0f} tok/s, sync {r['publish_bytes'] / 1e6:.1f} MB"
        elif r["part"] == "fsdp2" and "step_s" in r:
            what = "one rank, NCCL"
            figure = f"step {r['step_s']:.2f} s, diff {r['max_abs_diff_vs_plain']:.1e}"
        elif r["part"] == "nccl_setup" and "setup_s" in r:
            figure = f"set-up {r['setup_s'] * 1e3:.0f} ms"
        elif r["part"] == "fork_safe" and "child_after_visible_devices" in r:
            figure = f"forked child exit {r['child_after_visible_devices'].split()[-1]}"
        elif r["part"] == "gpu_tests":
            figure = r.get("summary", "")[:38]
        elif "error" in r:
            figure = r["error"][:38]
        lines.append(f"{r['part']:<11} {r.get('shape', ''):<13} {what:<34} {figure:<38} {'yes' if r['ok'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, CUDA-only parts skipped")
    parser.add_argument("--shapes", default="", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--parts",
                        default="gpu_tests,fork_safe,nccl_setup,train,mfu,cuda_ipc,engine_receive,park,lora,fsdp2")
    parser.add_argument("--batch", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=384)
    parser.add_argument("--iterations", type=int, default=3, help="timed micro-batch + step iterations")
    parser.add_argument("--syncs", type=int, default=5, help="weight syncs of the cuda_ipc part (the first maps)")
    parser.add_argument("--tests-timeout", type=float, default=420.0)
    parser.add_argument("--models", default="", help="where to build the models (default: a temporary directory)")
    parser.add_argument("--out", default="", help="also write the JSON rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from flexmarl.workers.precision import cuda_device_count

    if args.dry_run:
        device = torch.device("cpu")
        shapes = args.shapes.split(",") if args.shapes else ["tiny-qwen2"]
        args.batch, args.prompt_len, args.output_len, args.iterations, args.syncs = 2, 8, 8, 1, 3
    elif cuda_device_count() == 0:
        print("no CUDA device here; use --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda:0")
        shapes = args.shapes.split(",") if args.shapes else ["qwen2.5-0.5b", "qwen2.5-1.5b", "llama3.2-1b"]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    parts = set(args.parts.split(","))
    emit({"part": "env", "ok": True, "torch": torch.__version__, "device": str(device),
          "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "shapes": shapes, "dry_run": args.dry_run})
    for part, why in NOT_RUN.items():
        emit({"part": part, "ok": True, "not_run": why})

    with contextlib.ExitStack() as stack:
        root = Path(args.models) if args.models else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if "gpu_tests" in parts:
            run_gpu_tests(args)
        if "nccl_setup" in parts:
            run_nccl_setup(args, device)
        if "fork_safe" in parts:
            run_fork_safe(args, device)
        for shape in shapes:
            try:
                t0 = time.perf_counter()
                path = build_model(shape, root, device)
                emit({"part": "build", "shape": shape, "ok": True, "seconds": time.perf_counter() - t0})
            except Exception as exc:  # noqa: BLE001
                failed({"part": "build", "shape": shape}, exc)
                continue
            if "train" in parts:
                run_train(args, shape, path, device)
            if "mfu" in parts and (shape == MFU_SHAPE or args.dry_run and shape == shapes[0]):
                run_mfu(args, shape, path, device)
            if "cuda_ipc" in parts:
                run_cuda_ipc(args, shape, path, device)
            if "engine_receive" in parts:
                run_engine_receive(args, shape, path, device)
            if "park" in parts:
                run_park(args, shape, path, device)
            if "lora" in parts and shape == shapes[0]:
                run_lora(args, shape, path, device)
            if "fsdp2" in parts and shape == shapes[0]:
                run_fsdp2(args, shape, path, device)
    print(table(ROWS), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    bad = [r for r in ROWS if not r["ok"]]
    if bad:
        print(f"GPU CHECK FAILED: {len(bad)} part(s): {', '.join(sorted({r['part'] for r in bad}))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
