"""A trainer group: N processes that train each agent together, seen by the controller as
one trainer.

Rank 0 is the trainer worker connected to the controller. At start it launches ranks
1..N-1 itself (`python -m flexmarl.workers.trainer.group --rank R ...`), and all N join one
torch.distributed process group (gloo on CPU, NCCL between GPUs, plus a gloo group for
control traffic). Each command rank 0 receives is relayed to the other ranks before it runs
(the message's own msgpack bytes, broadcast as a uint8 tensor; never pickle), and every
rank executes it on its part of the state. The commands are the trainer's, written once in
worker.py; this class overrides only the steps that differ per rank (build and wrap a
model, receive a shard, deal out samples and add up their sums, gather the full weights,
park a rank's local shard; `rank` 0 is the root):

- INIT_AGENT / LOAD_AGENT: the model is sharded with FSDP2 (`fully_shard` on every decoder
  layer, then the root); each rank holds 1/N of the weights, gradients and optimizer state.
- TRAIN_MICROBATCH: the samples are dealt out, rank r taking samples r, r + N, ...; FSDP
  averages the gradients across ranks and each rank's loss is scaled by N, so they are
  sums (the loss is a sum over samples and the optimizer step divides once), and the step
  sums are all-reduced so every rank checks the same counts. A rank dealt no sample runs one with zero advantage and no KL term: FSDP's
  collectives need every rank in every forward and backward, and its gradient is zero.
- OPTIM_STEP: each rank clips (on the global norm) and steps its own shard.
- PUBLISH_WEIGHTS: the full weights are gathered one at a time as rank 0 packs them into
  its bucket (every rank takes part in each gather, in order), and published (over NCCL,
  on the agent's communicator the controller names).
- OFFLOAD_AGENT / LOAD_AGENT / RELEASE_STATE: each rank parks its own shard in its own
  parameter channel; rank 0 replies with its handle, the other ranks' in `shards`, and a
  later LOAD_AGENT hands rank r its own shard back (each rank copies it in; on the group that
  parked it, the copy is then released). A state parked by a group of another size cannot
  be loaded (the shards would not line up) and is refused. A parked agent's checkpoint is
  written by swapping it in: the group keeps no whole state of it.
- SAVE_CHECKPOINT: the full weights are gathered once; rank 0 writes them.

Only rank 0 replies. After each command the ranks agree on whether all succeeded; a rank
that failed is named in rank 0's error. Ranks 1..N-1 exit when rank 0 closes the group or
disappears.

It knows torch.distributed, FSDP2 and the trainer's commands; nothing about sockets or the
controller.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from flexmarl.runtime import protocol

from ..precision import TrainPlacement
from .batch import Sample
from .loss import StepSums
from .worker import AgentState, TrainerHandler, model_skeleton, training_state

log = logging.getLogger("flexmarl.trainer_group")

STOP = b""  # relayed instead of a command: the group is closing
JOIN_TIMEOUT_S = 300.0  # ranks start by importing torch and transformers: slow on small machines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(t: Any) -> torch.Tensor:
    """A rank's own part of a sharded tensor (a DTensor), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class TrainerGroupHandler(TrainerHandler):
    """One rank's trainer. Rank 0 builds it with `start`, the others with `join`."""

    def __init__(self, rank: int, world: int, device: str, channel_config: Any = None) -> None:
        super().__init__(channel_config)
        self.rank, self.world, self.device = rank, world, device
        self.children: list[subprocess.Popen] = []
        self.control: Any = None  # the gloo group commands, handles and counts travel in
        self.mesh: Any = None
        # FSDP averages gradients over the ranks (gloo has no pre-scaled sum); the losses are
        # sums over samples and the step divides once, so each rank's loss is scaled by N.
        self.loss_scale = float(world)

    # ---------------------------------------------------------------- forming the group

    @classmethod
    def start(cls, world: int, threads: int = 1, channel_config: Any = None) -> TrainerGroupHandler:
        """Rank 0: launch ranks 1..world-1 on this host, one GPU each when there are GPUs
        (rank r gets the r-th GPU this process sees), and join them."""
        gpus = []
        if torch.cuda.is_available():
            visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
            gpus = visible or [str(i) for i in range(torch.cuda.device_count())]
            if len(gpus) < world:
                raise RuntimeError(f"a trainer group of {world} ranks needs {world} GPUs; this worker sees "
                                   f"{len(gpus)} ({','.join(gpus)}); set cluster.trainer_gpus")
        address = f"tcp://127.0.0.1:{free_port()}"
        children = []
        for rank in range(1, world):
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[rank]
            children.append(subprocess.Popen(
                [sys.executable, "-m", "flexmarl.workers.trainer.group", "--rank", str(rank), "--world",
                 str(world), "--init", address, "--threads", str(threads)], env=env, stdin=subprocess.DEVNULL))
        handler = cls(0, world, "cuda:0" if gpus else "cpu", channel_config)  # rank 0 publishes
        handler.children = children
        try:
            handler._join(address)
        except BaseException:
            handler._stop_children()
            raise
        log.info("trainer group of %d ranks formed (ranks 1..%d: pids %s)", world, world - 1,
                 [c.pid for c in children])
        return handler

    def _join(self, address: str) -> None:
        from datetime import timedelta

        from torch.distributed.device_mesh import init_device_mesh

        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        # Commands travel on their own gloo group with no practical time limit: a rank may
        # wait for the next command as long as the controller has no work for this trainer.
        # A rank that dies breaks the connections at once; a lost rank 0 ends the others
        # through their parent watch.
        self.control = dist.new_group(backend="gloo", timeout=timedelta(days=30))
        self.mesh = init_device_mesh(torch.device(self.device).type, (self.world,))

    # ---------------------------------------------------------------- relaying commands

    def _broadcast_bytes(self, payload: bytes, src: int) -> bytes:
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src, group=self.control)
        if not int(size):
            return b""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == src \
            else torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src, group=self.control)
        return data.numpy().tobytes()

    def _execute(self, msg: protocol.Message) -> protocol.Message:
        """Rank 0: relay the command, run it here, and fail if any rank failed."""
        self._broadcast_bytes(bytes(protocol.encode_one(msg)), 0)
        return self._run_everywhere(msg)

    def _run_everywhere(self, msg: protocol.Message) -> Any:
        error: Exception | None = None
        reply = None
        try:
            reply = self.COMMANDS[type(msg)](self, msg)
        except Exception as exc:  # reported after the ranks agree on the outcome
            error = exc
        failed = torch.tensor([self.rank + 1 if error else 0], dtype=torch.int64)
        dist.all_reduce(failed, dist.ReduceOp.MAX, group=self.control)
        if error is not None:
            raise error
        if int(failed):
            raise RuntimeError(f"rank {int(failed) - 1} of the trainer group failed {type(msg).__name__} "
                               "(its log says why); the agent's state may now differ between ranks")
        return reply

    def follow(self) -> None:
        """Ranks 1..N-1: run rank 0's commands until it closes the group."""
        while True:
            payload = self._broadcast_bytes(b"", 0)
            if payload == STOP:
                return
            msg, _ = protocol.decode([payload])
            try:
                self._run_everywhere(msg)
            except Exception:
                log.exception("rank %d: %s failed", self.rank, type(msg).__name__)

    # ---------------------------------------------------------------- the steps that differ per rank

    def _shard(self, model: Any, placement: TrainPlacement) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Mixed precision is FSDP's job here: float32 shards, compute in the lower dtype,
        # gradients reduced in float32.
        policy = MixedPrecisionPolicy(param_dtype=placement.compute_dtype, reduce_dtype=torch.float32) \
            if placement.autocasts else MixedPrecisionPolicy()
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        units = [m for m in model.modules() if type(m).__name__ in blocks] + [model]
        for unit in units:
            fully_shard(unit, mesh=self.mesh, mp_policy=policy)
        return model

    def _new_model(self, msg: protocol.InitAgent | protocol.LoadAgent,
                   pretrained: bool) -> tuple[Any, Any, TrainPlacement]:
        from transformers import AutoModelForCausalLM

        placement = TrainPlacement.resolve(msg.settings, self.device)
        if pretrained:
            model = AutoModelForCausalLM.from_pretrained(msg.model_path, dtype=placement.param_dtype)
        else:
            model = model_skeleton(msg.model_path, placement.param_dtype)  # the parked state is copied in
        placement.prepare(model)
        self._shard(model, placement)
        optimizer = torch.optim.Adam(model.parameters(), lr=msg.lr)
        # FSDP does the mixed precision; an autocast on top would only cast twice.
        return model, optimizer, TrainPlacement(placement.device, placement.param_dtype, placement.param_dtype,
                                                placement.activation_checkpointing,
                                                serve_dtype=placement.compute_dtype)

    def _receive(self, msg: protocol.LoadAgent, model: Any, optimizer: Any,
                 placement: TrainPlacement) -> tuple[StepSums, None]:
        return receive_shard(self.channel(), ([msg.handle] + list(msg.shards))[self.rank], model, optimizer), None

    def _share(self, samples: list[Sample], loss: protocol.LossOptions) -> tuple[list[Sample], protocol.LossOptions, bool]:
        """Rank r trains samples r, r + N, ...; a rank dealt none runs the zero-gradient stand-in."""
        share = samples[self.rank::self.world]
        if share:
            return share, loss, True
        return [samples[0].with_advantage(0.0)], msgspec.structs.replace(loss, kl_coef=0.0, teacher_coef=0.0), False

    def _reduce(self, sums: StepSums) -> StepSums:
        tensors = sums.to_tensors()
        names = [n for n in tensors if n != "length_max"]
        summed = torch.stack([tensors[n] for n in names])
        dist.all_reduce(summed, group=self.control)
        longest = tensors["length_max"].reshape(1).clone()
        dist.all_reduce(longest, dist.ReduceOp.MAX, group=self.control)
        return StepSums.from_tensors({**dict(zip(names, summed)), "length_max": longest[0]})

    def _full_weight(self, param: Any, dtype: Any) -> Any:
        # Gathered (every rank takes part) when rank 0's publish packs it, its shard cast
        # first: the gather moves the served dtype's bytes, not float32's.
        return param.detach().to(dtype).full_tensor()

    def _park(self, state: AgentState, transport: str) -> list[Any]:
        """Each rank parks a copy of its own shard (the sharded tensors' local parts); the
        live shards go with the agent once every rank's copy is made."""
        local = {k: _local(v) for k, v in training_state(state.model, state.optimizer, state.sums).items()}
        handle = self.channel().publish(local, agent=state.name, version=state.version, transport=transport)
        handles = self._gather_handles(handle)
        self.parked[handles[0].key] = handle  # every rank files its own part under rank 0's key
        return handles

    def _gather_handles(self, handle: Any) -> list[Any]:
        encoded = msgspec.msgpack.encode(handle)
        return [msgspec.msgpack.decode(self._broadcast_bytes(encoded if r == self.rank else b"", r),
                                       type=type(handle)) for r in range(self.world)]

    def _checkpoint_state_dict(self, state: AgentState) -> dict[str, Any]:
        return {k: v.detach().full_tensor().cpu() for k, v in state.model.state_dict().items()}

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        if self.rank == 0 and dist.is_initialized():
            try:
                self._broadcast_bytes(STOP, 0)
            except Exception as exc:
                log.warning("could not tell the other ranks to stop (%r); stopping them by pid", exc)
        self._stop_children()
        if dist.is_initialized():
            dist.destroy_process_group()
        super().close()

    def _stop_children(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank process %d did not exit; killing it", child.pid)
                child.kill()
                child.wait(5.0)
        self.children = []


def receive_shard(channel: Any, handle: Any, model: Any, optimizer: Any) -> StepSums:
    """This rank's parked shard into a freshly sharded model: weights straight into the
    local shards, gradients and optimizer state as new tensors wrapped to the parameters'
    sharding. On any error the model must be thrown away."""
    from torch.distributed.tensor import DTensor

    from flexmarl.runtime.params.channel import ParamTransferError, torch_dtype

    params = dict(model.named_parameters())
    dst = {}
    for spec in handle.layout:
        kind, _, rest = spec.name.partition("/")
        name = rest.split("/", 1)[0]
        if kind == "param" and name in params:
            dst[spec.name] = _local(params[name])
        elif kind in ("grad", "optim", "step") and (kind == "step" or name in params):
            dst[spec.name] = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
        else:
            raise ParamTransferError(f"parked shard of {handle.agent!r} has {spec.name!r}, which this model lacks")
    missing = [name for name in params if f"param/{name}" not in dst]
    if missing:
        raise ParamTransferError(f"parked shard of {handle.agent!r} lacks {missing[:5]}")
    channel.receive_into(handle, dst, atomic=False)

    def like(p: Any, local: torch.Tensor) -> Any:
        if not isinstance(p, DTensor) or local.dim() == 0:  # step counters are plain scalars
            return local
        return DTensor.from_local(local.to(_local(p).device), p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride(), run_check=False)

    for name, p in params.items():
        if f"grad/{name}" in dst:
            p.grad = like(p, dst[f"grad/{name}"])
        prefix = f"optim/{name}/"
        state = {k[len(prefix):]: like(p, v) for k, v in dst.items() if k.startswith(prefix)}
        if state:
            optimizer.state[p] = state
    return StepSums.from_tensors({k[len("step/"):]: v for k, v in dst.items() if k.startswith("step/")})


def _exit_with_parent(parent: int) -> None:
    """Ranks 1..N-1 live only as long as rank 0: an orphan would wait in a collective forever."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flexmarl trainer rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="rank 0's rendezvous address, tcp://HOST:PORT")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from flexmarl.runtime.aio import limit_threads, setup_logging

    limit_threads(args.threads)
    setup_logging("INFO", name=f"trainer-rank{args.rank}")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    handler = TrainerGroupHandler(args.rank, args.world, "cuda:0" if torch.cuda.is_available() else "cpu")
    handler._join(args.init)
    try:
        handler.follow()
    finally:
        handler.close()  # unlinks the shards this rank parked


if __name__ == "__main__":
    main()
