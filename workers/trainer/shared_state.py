"""An agent's training state in one shared-memory bucket, so that parking it is handing it over.

A trainer of one process keeps what an agent's training state is made of (weights,
gradients, optimizer moments, the sums of the step in progress) as views of one
`SharedBucket` of its parameter channel, laid out under `training_state`'s names:

- on the CPU from the moment the agent arrives (`adopt`: the model's tensors are copied in
  once and the model and optimizer pointed at the views; `receive`: a copy parked
  elsewhere, or a checkpoint's file, is received straight into a new bucket). Parking
  then publishes the bucket as it is (`park`: sealed in place, no copy; its checksum is
  computed on a thread while the reply goes back), and a swap-in on the same trainer
  unseals it (`take_back`): a parked agent's memory is the live state's, counted once.
  The weights lead the bucket, so a weight sync over shm seals them where they are
  (`weights`): no copy either;
- on a GPU the live state stays on the device; parking copies it into a bucket tensor by
  tensor and points the model at the copies (the device memory goes with the last
  reference), and the swap-in copies each tensor back: never a whole second state at once.

Gradients live in the bucket too, zeroed in place after each step (`zero_grads`) instead
of freed, so a state parked between steps and one parked mid-batch are the same bytes and
a backward pass adds into them where they are. The optimizer's state is made when the
agent arrives, with the constructors `torch.optim.Adam`'s lazy initialisation uses (the
trainer's only optimizer; a test holds the two equal, bit for bit, over several steps).

Hand-written because no library keeps a torch model's parameters, gradients and optimizer
state in one caller-owned buffer. It knows the parameter channel and the names of a
training state; not agents' versions, the controller, or when to park.
"""

from __future__ import annotations

from typing import Any

import torch

from flexmarl.runtime.params.stream import TensorStream

from .loss import STEP_SUM_FIELDS, StepSums


def adam_state_specs(optimizer: Any, p: torch.Tensor) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The state `torch.optim.Adam` makes for `p` on its first step (its `_init_group`: a
    float32 step counter on the CPU, moments shaped and typed like `p`, all zero), for the
    settings the trainer uses; anything else is refused rather than guessed."""
    group = optimizer.param_groups[0]
    if type(optimizer) is not torch.optim.Adam or group["amsgrad"] or group["fused"] or group["capturable"]:
        raise ValueError(f"the shared training state knows plain Adam's state only, not {optimizer!r}")
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # as Adam's
    return {"step": (step_dtype, ()), "exp_avg": (p.dtype, tuple(p.shape)), "exp_avg_sq": (p.dtype, tuple(p.shape))}


def state_specs(model: Any, optimizer: Any) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]],
                                                     dict[str, torch.Tensor]]:
    """Every tensor of the agent's training state: name -> (dtype, shape), and name -> the
    tensor it holds now where there is one (else it starts at zero). Weights, then
    optimizer state, then the step sums, then gradients."""
    params = [(name, p) for name, p in model.named_parameters()]
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    now: dict[str, torch.Tensor] = {}
    for name, p in params:
        specs[f"param/{name}"] = (p.dtype, tuple(p.shape))
        now[f"param/{name}"] = p.detach()
    for name, p in params:
        if p.requires_grad:
            held = optimizer.state.get(p) or {}
            made = {k: (v.dtype, tuple(v.shape)) for k, v in held.items()} if held else adam_state_specs(optimizer, p)
            for key, spec in made.items():
                specs[f"optim/{name}/{key}"] = spec
                if key in held:
                    now[f"optim/{name}/{key}"] = held[key].detach()
    for field in sorted(STEP_SUM_FIELDS):
        specs[f"step/{field}"] = (torch.float64, ())
    for name, p in params:  # last: what a checkpoint writes (no gradients) is the bucket's first part
        if p.requires_grad:
            specs[f"grad/{name}"] = (p.dtype, tuple(p.shape))
            if p.grad is not None:
                now[f"grad/{name}"] = p.grad.detach()
    return specs, now


class SharedTrainingState:
    """One agent's training state as views of one SharedBucket (see the module doc)."""

    def __init__(self, bucket: Any) -> None:
        self.bucket = bucket
        self.handle: Any = None  # its publication while parked
        self._weights: Any = None  # the leading part holding the weights (`weights`)
        _zero_padding(bucket)  # a reused segment holds old bytes there; a written-out bucket is the same every time
        grads = [spec for spec in bucket.layout if spec.name.startswith("grad/")]
        # The gradients are consecutive in the layout (its last part): zeroing them is one memset.
        self._grads = (grads[0].offset, grads[-1].offset + grads[-1].nbytes) if grads else (0, 0)

    @classmethod
    def adopt(cls, channel: Any, model: Any, optimizer: Any) -> SharedTrainingState:
        """The model's and optimizer's state copied into a new bucket, tensor by tensor
        (from any device), and the two pointed at it."""
        specs, now = state_specs(model, optimizer)
        shared = cls(channel.shared_bucket(TensorStream(specs, _made_by_the_copy), copy=False))
        with torch.no_grad():
            for name, view in shared.bucket.tensors.items():
                view.copy_(now[name]) if name in now else view.zero_()  # a reused segment holds old bytes
        shared.point(model, optimizer)
        return shared

    @classmethod
    def receive(cls, channel: Any, handle: Any, model: Any, optimizer: Any) -> tuple[SharedTrainingState, StepSums]:
        """A parked copy (or a checkpoint's training state file) received straight into a
        new bucket laid out for `model`, verified on the way, and the model and optimizer
        pointed at it; what the copy lacks (gradients between steps, optimizer state
        before the first step) starts at zero. On any error the bucket is freed, the model
        left as it was."""
        from flexmarl.runtime.params.channel import ParamTransferError

        specs, _ = state_specs(model, optimizer)
        sent = {spec.name for spec in handle.layout}
        unknown = [name for name in sent if name not in specs]
        missing = [name for name in specs if name.startswith("param/") and name not in sent]
        if unknown or missing:
            raise ParamTransferError(f"parked state of {handle.agent!r} does not fit this model: it has "
                                     f"{unknown[:5]} which the model lacks, and lacks {missing[:5]}")
        shared = cls(channel.shared_bucket(TensorStream(specs, _made_by_the_copy), copy=False))
        try:
            with torch.no_grad():
                for name, view in shared.bucket.tensors.items():
                    if name not in sent:
                        view.zero_()
            channel.receive_into(handle, {name: shared.bucket.tensors[name] for name in sent}, atomic=False)
        except BaseException:
            shared.bucket.close()
            raise
        shared.point(model, optimizer)
        return shared, shared.sums()

    def point(self, model: Any, optimizer: Any) -> None:
        """The model's parameters and gradients and the optimizer's state become the views."""
        views = self.bucket.tensors
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for name, view in views.items():
            kind, _, rest = name.partition("/")
            if kind == "optim":
                param, _, key = rest.rpartition("/")
                optim.setdefault(param, {})[key] = view
        for name, p in model.named_parameters():
            p.data = views[f"param/{name}"]
            if f"grad/{name}" in views:
                p.grad = views[f"grad/{name}"]
            if name in optim:
                optimizer.state[p] = optim[name]

    def sums(self) -> StepSums:
        return StepSums.from_tensors({f: self.bucket.tensors[f"step/{f}"] for f in STEP_SUM_FIELDS})

    def weights(self) -> Any:
        """The weights alone, under their parameter names, as the leading part of the bucket
        (they come first): published over shm they are sealed where they live, no copy."""
        if self._weights is None:
            count = sum(1 for spec in self.bucket.layout if spec.name.startswith("param/"))
            self._weights = self.bucket.leading(count, lambda name: name.removeprefix("param/"))
        return self._weights

    def saved_tensors(self, sums: StepSums) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps, as views of the bucket in its order (weights, optimizer
        state, step sums with `sums` written into them; no gradients): one contiguous part
        of it, which the disk transport writes as it is."""
        if self.handle is None:  # parked, they were written then: a publication never changes
            self._write_sums(sums)
        return {name: view for name, view in self.bucket.tensors.items() if not name.startswith("grad/")}

    def _write_sums(self, sums: StepSums) -> None:
        with torch.no_grad():
            for field, value in sums.to_tensors().items():
                self.bucket.tensors[f"step/{field}"].copy_(value)

    def zero_grads(self) -> None:
        """Every gradient back to zero where it is (after a step)."""
        start, end = self._grads
        self.bucket.segment.data[start:end].zero_()

    def park(self, channel: Any, agent: str, version: int, sums: StepSums, transport: str = "shm") -> Any:
        """Publishes the state as it is (over shm: the bucket sealed in place, nothing
        copied) with the step sums written into it; the handle, until `take_back` or
        `release`. No tensor of it may change meanwhile."""
        self._write_sums(sums)
        self.handle = channel.publish(self.bucket, agent=agent, version=version, transport=transport)
        return self.handle

    def take_back(self, channel: Any, model: Any, optimizer: Any, device: torch.device) -> bool:
        """The parked state becomes live again on this trainer: the publication ends (a
        checksum still being computed is abandoned: nobody else read it). On the CPU the
        views stay what the model computes with; on a GPU each tensor is copied back to
        the device, one at a time, and the bucket is freed. True while the state stays in
        the bucket."""
        channel.release(self.handle)
        self.handle = None
        if device.type == "cpu":
            return True
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
                state = optimizer.state.get(p)
                if state:  # the step counter stays on the CPU, where Adam keeps it
                    optimizer.state[p] = {k: v.clone() if k == "step" else v.to(device) for k, v in state.items()}
        self.bucket.close()
        return False

    def release(self, channel: Any) -> None:
        """The parked state is dropped (its agent lives on elsewhere): its memory goes."""
        if self.handle is not None:
            channel.release(self.handle)
            self.handle = None
        self.bucket.close()


def _zero_padding(bucket: Any) -> None:
    data, end = bucket.segment.data, 0
    for spec in bucket.layout:
        data[end:spec.offset].zero_()
        end = spec.offset + spec.nbytes
    data[end:].zero_()


def _made_by_the_copy(name: str) -> torch.Tensor:
    raise AssertionError(f"{name}: a shared state's bucket is filled by copying, never from its stream")
