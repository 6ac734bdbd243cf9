"""Trainer worker: owns agents' torch models and optimizers; executes training commands.

Commands run one at a time on a worker thread (so heartbeats keep flowing while a
backward pass runs), in arrival order, except that any other command passes queued
micro-batches of other agents (`CommandQueue`): INIT_AGENT, TRAIN_MICROBATCH (forward/backward,
gradients accumulate), OPTIM_STEP (end the last publication, one step, zero the gradients, bump the version),
PUBLISH_WEIGHTS (hand the weights to the parameter channel; the bytes go straight to the
rollout workers; from a shared training state over shm, sealed where they live), SAVE_CHECKPOINT (Hugging Face safetensors, and the whole training state
for resuming), and the swaps of
agent-centric training: OFFLOAD_AGENT (park the whole training state in the channel and
stop holding it), LOAD_AGENT (rebuild it from a parked copy, here or on another trainer),
RELEASE_STATE (drop a parked copy once its new owner has it).

A trainer of one process parks an agent without a second copy and keeps it whole
(shared_state.py): on the CPU its training state lives in a shared-memory bucket from the
start, and parking publishes that bucket as it is; a LOAD_AGENT of a copy it parked
itself takes it back (nothing is built or copied on the CPU), and SAVE_CHECKPOINT of a
parked agent writes it from the kept state, without a swap-in.

An agent that is a LoRA adapter (InitAgent/LoadAgent with `lora`) shares its base with the
trainer's other adapter agents of it (`adapters.SharedBase`, loaded once, frozen); its
model here is the adapter alone, so every command above moves the adapter and its
optimizer state, never the base.

Each command type maps to one method in `TrainerHandler.COMMANDS`, written once: a trainer
group (group.py) runs the same commands and overrides only the steps that differ
across ranks (`_new_model`, `_receive`, `_share`, `_reduce`, `_full_weight`, `_park`,
`_checkpoint_state_dict`; `rank` and `world`). The loss itself is in `loss.py`.

It decides nothing: which samples, when to step and where weights go all come from the
controller. It does check what it is told: a micro-batch for the wrong version, a sample
past the staleness bound, or a step that would cover other samples than the controller
meant is refused, and nothing is trained on it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

from flexmarl.runtime import protocol
from flexmarl.runtime.checksums import verify_files
from flexmarl.runtime.staleness import too_stale

from ..precision import TrainPlacement
from ..session import CommandHandler
from .batch import Sample, samples_of
from .loss import STEP_SUM_FIELDS, StepSums, policy_loss
from .proximal import PreviousWeights
from .shared_state import SharedTrainingState

log = logging.getLogger("flexmarl.trainer")


class CommandQueue:
    """The trainer's pending commands. A step, publish, swap or save is on the critical
    path of the next rollout, so it passes micro-batches queued before it, though never
    one of its own agent's: an agent's commands keep their order (the controller sends a
    step only after the agent's micro-batches are trained, and a swap only while the agent
    has nothing in flight, so this never reorders what depends on each other).

    Unbounded on purpose: the controller bounds what it sends (its command slots), and
    dropping a command would lose gradients."""

    def __init__(self) -> None:
        self._pending: list[protocol.Message] = []
        self._arrived = asyncio.Event()

    def put(self, msg: protocol.Message) -> None:
        self._pending.append(msg)
        self._arrived.set()

    async def get(self) -> protocol.Message:
        while not self._pending:
            self._arrived.clear()
            await self._arrived.wait()
        return self._pending.pop(self._next_index())

    def _next_index(self) -> int:
        waiting: set[str] = set()  # agents with a micro-batch queued ahead
        for index, msg in enumerate(self._pending):
            if isinstance(msg, protocol.TrainMicroBatch):
                waiting.add(msg.agent)
            elif getattr(msg, "agent", None) not in waiting:
                return index
        return 0

    def qsize(self) -> int:
        return len(self._pending)


@dataclass
class AgentState:
    name: str
    model: Any
    optimizer: Any
    model_path: str
    version: int
    max_grad_norm: float
    sums: StepSums = field(default_factory=StepSums)  # what the gradients accumulated since the last step cover
    published: Any = None  # the parameter-channel handle of the latest published weights
    # Its training state in shared memory (shared_state.py): on the CPU while resident and
    # parked, on a GPU while parked; None otherwise (a GPU's live state, a trainer group's).
    shared: Any = None
    # The frozen initial weights a KL penalty pulls towards. Never parked: they are the
    # model at `model_path`, rebuilt from there on first use after the agent moves.
    reference: Any = None
    # Device and number formats (precision.py); the default is float32 on the CPU.
    placement: TrainPlacement = field(default_factory=lambda: TrainPlacement.resolve(protocol.TrainerSettings(), "cpu"))
    # A LoRA adapter on a base this trainer shares (`bases`): its model is the adapter, and
    # it holds a place on the base until its state leaves this trainer.
    adapter: bool = False
    # Decoupled PPO's proximal policy: the weights before the last step, kept from the first
    # micro-batch that asks for them on (proximal.py).
    previous: PreviousWeights = field(default_factory=PreviousWeights)
    keeps_previous: bool = False

    @property
    def accumulated(self) -> int:
        """Samples whose gradients are accumulated since the last step."""
        return int(self.sums.samples)


def training_state(model: Any, optimizer: Any, sums: StepSums | None = None, grads: bool = True) -> dict[str, Any]:
    """Everything needed to resume training exactly: weights, pending gradients (none with
    grads=False: between steps they are zero), the optimizer's per-parameter state and the
    sums of the step in progress, as one flat name -> tensor map."""
    # Parameters, not the state dict: a tied head is the embedding itself, listed once.
    tensors = {f"param/{k}": v.detach() for k, v in model.named_parameters()}
    tensors.update({f"step/{k}": v for k, v in (sums.to_tensors() if sums else {}).items()})
    for name, p in model.named_parameters():
        if grads and p.grad is not None:
            tensors[f"grad/{name}"] = p.grad.detach()
        for key, value in optimizer.state.get(p, {}).items():
            tensors[f"optim/{name}/{key}"] = value.detach()
    return tensors


def model_skeleton(model_path: str, dtype: Any, device: Any = "cpu") -> Any:
    """The model of `model_path`'s config with its parameters allocated on `device` but not
    initialised, for a state that is about to be copied in (a swap-in, a resume): on a GPU
    straight into device memory, never a whole copy in host memory first. Initialising
    first would write every weight twice: for a 0.5B model, random init takes longer than
    the copy itself. Buffers computed at construction (rotary frequencies) are still built."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):  # it skips tying too: a tied head would be a separate tensor
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
    model.tie_weights()
    return model


def receive_training_state(channel: Any, handle: Any, model: Any, optimizer: Any) -> StepSums:
    """Inverse of `training_state`: the parked state named by `handle` goes straight into a
    freshly built model (weights) and new tensors (gradients, optimizer state, step sums),
    one copy, verified on the way. On any error the half-filled model must be thrown away."""
    import torch

    from flexmarl.runtime.params.channel import ParamTransferError, torch_dtype

    params = dict(model.named_parameters())
    dst = {}
    for spec in handle.layout:
        kind, _, rest = spec.name.partition("/")
        name = rest.split("/", 1)[0]
        known = name in STEP_SUM_FIELDS if kind == "step" else name in params and kind in ("param", "grad", "optim")
        if not known:
            raise ParamTransferError(f"parked state of {handle.agent!r} has {spec.name!r}, "
                                     "which this model does not have")
        # Gradients and optimizer state beside their parameter (an adapter's already lives
        # on the GPU, on its shared base); Adam's step counter and the step sums on the CPU.
        on_cpu = kind == "step" or (kind == "optim" and spec.name.rsplit("/", 1)[-1] == "step")
        device = "cpu" if on_cpu else params[name].device
        dst[spec.name] = params[name] if kind == "param" else torch.empty(spec.shape, dtype=torch_dtype(spec.dtype),
                                                                          device=device)
    missing = [f"param/{name}" for name in params if f"param/{name}" not in dst]
    if missing:
        raise ParamTransferError(f"parked state of {handle.agent!r} lacks {missing[:5]}")
    channel.receive_into(handle, dst, atomic=False)
    for name, p in params.items():
        p.grad = dst.get(f"grad/{name}")
        prefix = f"optim/{name}/"
        state = {k[len(prefix):]: v for k, v in dst.items() if k.startswith(prefix)}
        if state:
            optimizer.state[p] = state
    return StepSums.from_tensors({k[len("step/"):]: v for k, v in dst.items() if k.startswith("step/")})


# A model directory's weight files: a checkpoint writes its own, never the model's.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".index.json")


def carried_with_weights(path: Path) -> bool:
    """A file of the model directory a checkpoint copies as it is: everything the
    tokenizer needs (tokenizer.json, its config, chat_template.jinja, vocab and merges
    files, sentencepiece models) and the generation config; not weights, not folders."""
    return path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES)


def write_checkpoint(path: str | Path, agent: str, model_path: str, write: Any) -> tuple[Path, int]:
    """Has `write(tmp)` fill a temporary directory next to `path`, adds the other files of
    `model_path` (tokenizer, chat template, generation config: they travel with the
    weights; `carried_with_weights`), then renames it to `path`: a crash or a
    full disk mid-save never leaves a half-written checkpoint there, and a failed save
    leaves nothing. Returns the path and the bytes written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        for extra in Path(model_path).iterdir():
            if carried_with_weights(extra) and extra.name != "config.json":  # the saved model's config stays
                shutil.copy(extra, tmp / extra.name)
        nbytes = sum(f.stat().st_size for f in tmp.iterdir())
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    except Exception as exc:  # OSError, or the safetensors writer's own error for the same causes
        shutil.rmtree(tmp, ignore_errors=True)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise OSError(f"cannot write the checkpoint of {agent} to {path}: {why} (nothing was left there)") from exc
    return path, nbytes


class TrainerHandler(CommandHandler):
    role = "trainer"
    # What each micro-batch's loss is multiplied by before backward. 1 here; a trainer group
    # whose gradient reduction averages over N ranks uses N, so the gradients are sums.
    loss_scale = 1.0
    rank, world = 0, 1  # this process among the ranks that hold each agent; rank 0 replies

    def __init__(self, channel_config: Any = None) -> None:
        super().__init__()
        self.channel_config = channel_config  # ParamChannelConfig; None: the channel's defaults
        self.agents: dict[str, AgentState] = {}
        self._commands = CommandQueue()
        self.busy_s = 0.0
        self._channel: Any = None
        self.parked: dict[str, Any] = {}  # handle key -> a copy of a training state this trainer parked
        self.kept: dict[str, AgentState] = {}  # handle key -> an agent parked here whole (`_park`)
        self.bases: dict[str, Any] = {}  # base model path -> adapters.SharedBase of its resident adapter agents

    async def handle(self, msg: protocol.Message, buffers: list[Any]) -> None:
        if type(msg) in self.COMMANDS:
            self._commands.put(msg)
        else:
            await super().handle(msg, buffers)

    async def run(self) -> None:
        while True:
            msg = await self._commands.get()
            started = time.perf_counter()
            try:
                reply = await asyncio.to_thread(self._execute, msg)
            except Exception as exc:  # one failed command is reported, the worker lives on
                log.exception("command %s failed", type(msg).__name__)
                request_id: int = cast(Any, msg).request_id  # every command carries one
                reply = protocol.Error(request_id, f"{type(msg).__name__} for "
                                                       f"{getattr(msg, 'agent', '?')} failed: {exc!r}")
            self.busy_s += time.perf_counter() - started
            await self.reply(reply)

    def load(self) -> dict[str, float]:
        return {"queued_commands": float(self._commands.qsize()), "busy_s": self.busy_s}

    def _execute(self, msg: protocol.Message) -> protocol.Message:
        reply = self.COMMANDS[type(msg)](self, msg)
        assert reply is not None  # only ranks other than 0 have no reply, and they never execute
        return reply

    def _resident(self, agent: str) -> AgentState:
        state = self.agents.get(agent)
        if state is None:
            raise KeyError(f"agent {agent!r} is not resident on this trainer "
                           f"(resident: {sorted(self.agents)})")
        return state

    def _held(self, agent: str) -> AgentState:
        """The agent's state where this trainer holds it: resident, or parked here whole."""
        kept = [state for state in self.kept.values() if state.name == agent]
        if agent in self.agents or not kept:
            return self._resident(agent)
        return kept[0]

    def _shares_state(self, placement: TrainPlacement) -> bool:
        """Whether an agent's live training state lives in shared memory (shared_state.py)."""
        return self.world == 1 and placement.device.type == "cpu"

    # ---------------------------------------------------------------- the steps a group overrides

    def _new_model(self, msg: protocol.InitAgent | protocol.LoadAgent,
                   pretrained: bool) -> tuple[Any, Any, TrainPlacement]:
        """A model for `msg.agent` with its optimizer: the model directory's weights
        (`pretrained`), or empty ones a parked state is received into (`_receive`)."""
        import torch
        from transformers import AutoModelForCausalLM

        placement = TrainPlacement.resolve(msg.settings)
        if msg.lora is not None:  # the base shared and frozen; the adapter is the model here
            model = self._new_adapter(msg, placement, msg.seed if pretrained and isinstance(msg, protocol.InitAgent) else 0)
        elif pretrained:
            model = AutoModelForCausalLM.from_pretrained(msg.model_path, dtype=placement.param_dtype)
            placement.prepare(model)
        else:  # the parked state is received into it, on its device (`_receive`)
            model = model_skeleton(msg.model_path, placement.param_dtype, placement.device)
        return model, torch.optim.Adam(model.parameters(), lr=msg.lr), placement

    def _receive(self, msg: protocol.LoadAgent, model: Any, optimizer: Any,
                 placement: TrainPlacement) -> tuple[StepSums, Any]:
        """This process's part of the parked state named in `msg` into a model of
        `_new_model`; its sums, and the SharedTrainingState it now lives in (or None)."""
        if self._shares_state(placement):
            shared, sums = SharedTrainingState.receive(self.channel(), msg.handle, model, optimizer)
        else:
            shared, sums = None, receive_training_state(self.channel(), msg.handle, model, optimizer)
        if msg.lora is None:  # an adapter is on its base's device already
            placement.prepare(model)
        placement.move_state(optimizer)
        return sums, shared

    def _share(self, samples: list[Sample], loss: protocol.LossOptions) -> tuple[list[Sample], protocol.LossOptions, bool]:
        """The part of a micro-batch's samples this process trains, under which loss
        settings, and whether it holds real samples."""
        return samples, loss, True

    def _reduce(self, sums: StepSums) -> StepSums:
        """Every process's sums of a micro-batch, added up."""
        return sums

    def _full_weights(self, state: AgentState, dtype: Any) -> Any:
        """The agent's whole parameters in `dtype` (a tied head once, as the embedding;
        receivers know the tie), as a TensorStream: each is made (`_full_weight`) as the
        publish packs it, so a trainer serving bfloat16 from float32 weights, or a group
        gathering its shards, never holds a second copy of the set."""
        from flexmarl.runtime.params.stream import TensorStream

        params = dict(state.model.named_parameters())
        return TensorStream({k: (dtype, tuple(v.shape)) for k, v in params.items()},
                            lambda k: self._full_weight(params[k], dtype), device=state.placement.device)

    def _full_weight(self, param: Any, dtype: Any) -> Any:
        """One whole parameter in `dtype`."""
        return param.detach().to(dtype)

    def _park(self, state: AgentState, transport: str) -> list[Any]:
        """Publishes the agent's training state for a LOAD_AGENT here or elsewhere; every
        process's handle, rank 0's first. Here the state is kept whole, in shared memory
        (`shared_state`: on the CPU it is there already, nothing is copied) until it is
        taken back or released."""
        if state.shared is None:  # on a GPU: copied to host memory tensor by tensor
            state.shared = SharedTrainingState.adopt(self.channel(), state.model, state.optimizer)
        handle = state.shared.park(self.channel(), state.name, state.version, state.sums, transport)
        state.reference = None  # rebuilt from the model path on first use after the swap-in
        state.previous.to("cpu")  # kept with the parked state, in host memory
        self.kept[handle.key] = state
        return [handle]

    def _checkpoint_state_dict(self, state: AgentState) -> dict[str, Any] | None:
        """The weights a checkpoint writes; None: the model's own."""
        return None

    # ---------------------------------------------------------------- the commands

    def _init_agent(self, msg: protocol.InitAgent) -> protocol.AgentReady:
        import torch

        torch.manual_seed(msg.seed)
        model, optimizer, placement = self._new_model(msg, pretrained=True)
        shared = SharedTrainingState.adopt(self.channel(), model, optimizer) if self._shares_state(placement) else None
        self.agents[msg.agent] = AgentState(msg.agent, model, optimizer, msg.model_path, 0, msg.max_grad_norm,
                                            placement=placement, shared=shared, adapter=msg.lora is not None)
        n = sum(p.numel() for p in model.parameters())
        log.info("agent %s resident: %d parameters from %s on %s (%s weights, %s compute)", msg.agent, n,
                 msg.model_path, placement.device, placement.param_dtype, placement.compute_dtype)
        return protocol.AgentReady(msg.request_id, msg.agent, 0, n)

    def _train(self, msg: protocol.TrainMicroBatch) -> protocol.MicroBatchDone:
        t0 = time.perf_counter()
        state = self._resident(msg.agent)
        if msg.version != state.version + 1:
            raise ValueError(f"micro-batch for version {msg.version} but {state.name} is at "
                             f"{state.version}; it can only accumulate towards {state.version + 1}")
        too_old = [str(g.key) for g in msg.groups if too_stale(state.version, g.versions, msg.max_staleness)]
        if too_old:  # the controller guarantees this never happens; refuse rather than trust
            raise ValueError(f"samples of groups {too_old[:3]} are older than version {state.version} - "
                             f"{msg.max_staleness}")
        samples, loss_options, real = self._share(samples_of(msg.groups), msg.loss)
        if loss_options.kl_coef > 0 and state.reference is None:
            state.reference = (state.model.reference() if hasattr(state.model, "reference")
                               else self._reference_model(state.model_path, state.placement))
        proximal = None
        if msg.max_staleness > 0 and loss_options.off_policy == "decoupled":
            state.keeps_previous = True  # from now on each step keeps the weights it changes
            if state.previous.tensors is not None:
                proximal = lambda: state.previous.in_place(state.model)  # noqa: E731
        with state.placement.autocast():
            loss, sums = policy_loss(state.model, samples, loss_options, off_policy=msg.max_staleness > 0,
                                     clip_ratio=msg.clip_ratio, reference=state.reference, proximal=proximal)
        (loss * self.loss_scale).backward()
        total = self._reduce(sums if real else StepSums())
        state.sums.add(total)
        return protocol.MicroBatchDone(msg.request_id, state.name, total.loss, int(total.tokens),
                                       time.perf_counter() - t0)

    @staticmethod
    def _reference_model(model_path: str, placement: TrainPlacement) -> Any:
        """The agent's initial weights, frozen. Loaded from its model path rather than
        copied and parked with the state: the path's weights never change during a run,
        and a swap then moves no extra bytes."""
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=placement.param_dtype)
        return reference.to(placement.device).eval().requires_grad_(False)

    def _step(self, msg: protocol.OptimStep) -> protocol.StepDone:
        import torch

        t0 = time.perf_counter()
        state = self._resident(msg.agent)
        if msg.version != state.version + 1:
            raise ValueError(f"optimizer step to version {msg.version} but {state.name} is at {state.version}")
        if msg.samples != state.accumulated:  # refused before anything changes: gradients are kept
            raise ValueError(f"optimizer step to {state.name} version {msg.version} should cover {msg.samples} "
                             f"samples, but {state.accumulated} were trained since the last step; not "
                             "applied: the controller and this trainer disagree on what was trained "
                             "(a micro-batch lost or sent twice?)")
        norm = torch.zeros(())
        # The controller sends a step only while no receiver reads the agent's publication
        # (it forgets the handle, under its sync lock): the step ends it, since the weights
        # it may be (shared_state) change in place now.
        self._end_publication(state)
        if state.keeps_previous:  # the next batch's proximal policy: this version's weights
            state.previous.keep(state.model)
        sums = state.sums
        skipped = False
        if sums.denominator > 0:  # 0: the global batch had no samples; the version still advances
            grads = [p.grad for p in state.model.parameters() if p.grad is not None]
            if grads:  # one multi-tensor call: a launch per parameter costs more on a GPU than the work
                torch._foreach_mul_(grads, 1 / sums.denominator)
            norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), state.max_grad_norm)
            # A non-finite gradient (one overflow is enough) would make every weight NaN:
            # the step is skipped instead, the weights and optimizer state left as they are.
            skipped = not bool(torch.isfinite(norm))
            if skipped:
                log.warning("%s: the gradient of the step to version %d is not finite (norm %s); step skipped, "
                            "weights unchanged", state.name, msg.version, float(norm))
            else:
                state.optimizer.step()
        if state.shared is not None:  # the gradients stay where they live
            state.shared.zero_grads()
        else:
            state.optimizer.zero_grad(set_to_none=True)
        state.version = msg.version
        state.sums = StepSums()
        return protocol.StepDone(msg.request_id, state.name, state.version, float(norm),
                                 time.perf_counter() - t0, sums.stats(float(norm), skipped))

    def _publish(self, msg: protocol.PublishWeights) -> protocol.WeightsPublished | None:  # None on ranks but 0
        t0 = time.perf_counter()
        state = self._resident(msg.agent)
        if msg.version not in (state.version, protocol.CURRENT_VERSION):
            raise ValueError(f"asked to publish {state.name} version {msg.version}, holding {state.version}")
        from flexmarl.runtime.params.stream import drain

        dtype = state.placement.publish_dtype  # the compute dtype, not mixed precision's float32
        source = self._full_weights(state, dtype)  # made one by one as rank 0 packs them
        try:
            return self._publish_from(source, msg, state, dtype, t0) if self.rank == 0 else None
        finally:
            if self.world > 1:  # each gather is a collective every rank makes, in the same order:
                drain(source)  # the other ranks here, rank 0 here too if its publish stopped halfway

    def _publish_from(self, source: Any, msg: protocol.PublishWeights, state: AgentState, dtype: Any,
                      t0: float) -> protocol.WeightsPublished:
        # Nobody reads the last publication any more (the controller sends a publish only
        # once the last one's receivers loaded it): it goes first, and its memory takes the
        # new one where it was a copy.
        self._end_publication(state)
        if state.shared is not None and msg.transport == "shm" and dtype == state.placement.param_dtype:
            # The weights where they live, sealed in place: the step ends the publication.
            source = state.shared.weights()
        handle = self.channel().publish(source, agent=state.name, version=state.version,
                                        transport=msg.transport,
                                        receivers=max(1, len(msg.targets)) * max(1, msg.ranks_per_target),
                                        group=msg.group)
        state.published = handle
        return protocol.WeightsPublished(msg.request_id, state.name, state.version, handle, handle.total_bytes,
                                         time.perf_counter() - t0)

    def _end_publication(self, state: AgentState) -> None:
        if state.published is not None:
            self.channel().release(state.published)
            state.published = None

    def channel(self) -> Any:
        if self._channel is None:
            from flexmarl.runtime.params.channel import ParamChannel
            self._channel = ParamChannel(self.channel_config)
        return self._channel

    def _offload(self, msg: protocol.OffloadAgent) -> protocol.AgentOffloaded:
        t0 = time.perf_counter()
        state = self._resident(msg.agent)
        self._end_publication(state)  # parking ends it (the controller forgets it): the segment is parked whole
        handles = self._park(state, msg.transport)
        del self.agents[state.name]  # the parked copy is complete; only now is the agent no longer resident
        return protocol.AgentOffloaded(msg.request_id, state.name, state.version, state.accumulated, handles[0],
                                       sum(h.total_bytes for h in handles), time.perf_counter() - t0,
                                       handles[1:])

    def _load_agent(self, msg: protocol.LoadAgent) -> protocol.AgentReady:
        if msg.agent in self.agents:
            raise ValueError(f"agent {msg.agent!r} is already resident here")
        kept = self.kept.get(msg.handle.key)
        if kept is not None:
            return self._take_back(msg, kept)
        if len(msg.shards) + 1 != self.world:
            raise ValueError(f"the parked state of {msg.agent} has {len(msg.shards) + 1} shards and this trainer "
                             f"has {self.world} ranks; a state moves only between trainers of the same size")
        if msg.checksum:  # a checkpoint's file: checked against its manifest before it is read
            if msg.handle.path is None:
                raise ValueError(f"the checkpointed state of {msg.agent} has a checksum but no file path")
            verify_files(Path(msg.handle.path).parent, {Path(msg.handle.path).name: msg.checksum})
        model, optimizer, placement = self._new_model(msg, pretrained=False)
        # Into a model built for it, verified on the way: a short or corrupt copy raises
        # and the model is dropped (an adapter leaves its base), so this trainer and the
        # parked copy stay as they were.
        try:
            sums, shared = self._receive(msg, model, optimizer, placement)
        except Exception:
            if msg.lora is not None:
                self._release_adapter(msg.model_path, msg.agent)
            raise
        ready = self._admit(msg, model, optimizer, sums, placement, shared)
        own = self.parked.pop(msg.handle.key, None)  # a copy this process parked: loaded, so it goes
        if own is not None:
            self.channel().release(own)
        return ready

    def _take_back(self, msg: protocol.LoadAgent, state: AgentState) -> protocol.AgentReady:
        """An agent this trainer parked whole becomes resident again (shared_state.py)."""
        if (state.version, state.accumulated) != (msg.version, msg.accumulated):
            raise ValueError(f"the state of {msg.agent} parked here is at version {state.version} with "
                             f"{state.accumulated} samples accumulated, the controller says {msg.version} and "
                             f"{msg.accumulated}; not loaded")
        del self.kept[msg.handle.key]
        if not state.shared.take_back(self.channel(), state.model, state.optimizer, state.placement.device):
            state.shared = None
        state.previous.to(state.placement.device)
        self.agents[msg.agent] = state
        return protocol.AgentReady(msg.request_id, msg.agent, state.version,
                                   sum(p.numel() for p in state.model.parameters()))

    def _new_adapter(self, msg: protocol.InitAgent | protocol.LoadAgent, placement: TrainPlacement,
                     seed: int) -> Any:
        """A new adapter for msg.agent on the shared base at msg.model_path, the base loaded
        if no resident agent uses it yet."""
        assert msg.lora is not None  # called for an agent that is an adapter
        from ..adapters import SharedBase

        base = self.bases.get(msg.model_path)
        if base is None:
            base = self.bases[msg.model_path] = SharedBase(msg.model_path, placement)
            log.info("base %s loaded once: %d parameters, frozen", msg.model_path, base.base_params)
        elif base.placement != placement:
            raise ValueError(f"{msg.agent}: the base {msg.model_path} is held here as {base.placement}; an adapter "
                             f"of it cannot be {placement} (set dtype and precision on the base)")
        return base.add(msg.agent, msg.lora, seed)

    def _release_adapter(self, base_path: str, agent: str) -> None:
        base = self.bases[base_path]
        base.remove(agent)
        if not base.agents:  # the last adapter agent of this base left: so does the base
            del self.bases[base_path]

    def _admit(self, msg: protocol.LoadAgent, model: Any, optimizer: Any, sums: StepSums,
               placement: TrainPlacement, shared: Any) -> protocol.AgentReady:
        """A received training state becomes resident, if it holds the gradients the
        controller says it does."""
        if int(sums.samples) != msg.accumulated:
            if shared is not None:
                shared.release(self.channel())
            raise ValueError(f"parked state of {msg.agent} holds gradients of {int(sums.samples)} samples, "
                             f"the controller says {msg.accumulated}; not loaded")
        self.agents[msg.agent] = AgentState(msg.agent, model, optimizer, msg.model_path, msg.version,
                                            msg.max_grad_norm, sums, placement=placement, shared=shared,
                                            adapter=msg.lora is not None)
        return protocol.AgentReady(msg.request_id, msg.agent, msg.version,
                                   sum(p.numel() for p in model.parameters()))

    def _release_state(self, msg: protocol.ReleaseState) -> protocol.StateReleased:
        kept = self.kept.pop(msg.handle.key, None)
        if kept is not None:  # loaded elsewhere: the agent lives on there
            kept.shared.release(self.channel())
            if kept.adapter:
                self._release_adapter(kept.model_path, kept.name)
            return protocol.StateReleased(msg.request_id, msg.agent)
        parked = self.parked.pop(msg.handle.key, None)
        if parked is None:
            raise KeyError(f"no parked state {msg.handle.key} for {msg.agent} on this trainer")
        self.channel().release(parked)
        return protocol.StateReleased(msg.request_id, msg.agent)

    def _save(self, msg: protocol.SaveCheckpoint) -> protocol.CheckpointSaved | None:  # None on ranks but 0
        """Weights in Hugging Face format (loadable by transformers and vLLM) and, with
        `full_state`, the whole training state as a disk file of the parameter channel.
        Written under a temporary name and renamed: a crash or a full disk mid-save never
        leaves a half-written checkpoint under `path`, and a failed save leaves nothing. A
        parked agent is written from the state this trainer keeps of it."""
        state = self._held(msg.agent)
        if msg.full_state and self.world > 1:
            raise ValueError(f"a trainer of {self.world} ranks saves the weights of {state.name} only; its "
                             "training state is sharded")
        if msg.full_state and state.accumulated:
            raise ValueError(f"a full checkpoint of {state.name} is taken between steps; {state.accumulated} "
                             "samples are accumulated towards the next one")
        handle = None
        weights = self._checkpoint_state_dict(state)  # every process takes part in gathering them
        if self.rank != 0:
            return None

        def write(tmp: Path) -> None:
            nonlocal handle
            state.model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
            if msg.full_state:
                tensors = (state.shared.saved_tensors(state.sums) if state.shared is not None
                           else training_state(state.model, state.optimizer, state.sums, grads=False))
                handle = self.channel().publish(tensors, agent=state.name, version=state.version,
                                                transport="disk", path=tmp / protocol.TRAINING_STATE_FILE)
                self.channel().disown(handle)  # the file belongs to the run directory now

        path, nbytes = write_checkpoint(msg.path, state.name, state.model_path, write)
        return protocol.CheckpointSaved(msg.request_id, state.name, str(path), state.version, handle, nbytes)

    # One table from command to method; `handle` queues exactly these.
    COMMANDS: dict[type[protocol.Message], Callable[[Any, Any], protocol.Message | None]] = {
        protocol.InitAgent: _init_agent,
        protocol.TrainMicroBatch: _train,
        protocol.OptimStep: _step,
        protocol.PublishWeights: _publish,
        protocol.SaveCheckpoint: _save,
        protocol.OffloadAgent: _offload,
        protocol.LoadAgent: _load_agent,
        protocol.ReleaseState: _release_state,
    }

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()  # unlinks every shared-memory segment it published or parked
