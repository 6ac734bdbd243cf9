"""A weight reload for CPU engines that copies into the model vLLM already built.

vLLM's `reload_weights` restores every layer's loading-time parameters, loads the
checkpoint through each parameter's weight loader, then runs each layer's post-loading step
again (on CPU: packing every linear layer's matrix for the matmul kernel, after which the
plain matrix is dropped). For a model of a few hundred thousand parameters nearly all of
its 17-19 ms is that machinery's Python, not copying: the kernel packing is about 5 ms.

`InPlaceReload` does only the copying and the packing. It works from a plan made once
from the checkpoint names: which vLLM module takes each tensor, and, for the fused layers
vLLM builds (q, k, v into `qkv_proj`; gate and up into `gate_up_proj`, in the model's
`packed_modules_mapping` order), where in the fused matrix it goes. Each reload then, once
every shape is checked, module by module
- copies plain parameters (norms, embeddings; an embedding's padded rows stay zero) in place;
- gives each linear layer whose matrix the kernel packing dropped the matrix of its fused
  rows (an unfused one: the received tensor itself), and each bias its fused values;
- runs the post-loading step of the module if it has one (the same step vLLM's reload
  runs), which packs the new matrix.
A fused matrix is put together in one staging buffer, kept across modules and reloads: the
packing copies it into the kernel's own layout, so the buffer is free again as soon as the
module is packed (unless the module kept it as its weight: then it is the module's, and a
new one is made). Fresh buffers for every layer would be faulted in at every reload. A
module never keeps a received tensor as its weight: those are views of the publisher's
memory, which its next publication reuses.

Hand-written because vLLM offers no reload without its layer-wise machinery. Only the
layouts it knows are taken: a CPU engine, one tensor-parallel rank, unquantized modules,
names that resolve to modules of the engine's model with the shapes the plan expects.
Anything else (`Plan.build` says why) goes through vLLM's reload, which is always
correct. A test compares both paths' tokens and logprobs on Llama (tied) and Qwen2 (untied,
with biases); the engine tests check all four layouts against transformers after a reload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class NotPlannable(Exception):
    """This model's weights cannot be reloaded in place; vLLM's reload is used instead."""


@dataclass
class Target:
    """One vLLM module and, per parameter name, the checkpoint tensors that fill it (in
    fused order; one for an unfused parameter)."""

    module_name: str
    parts: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Plan:
    names: frozenset[str]
    targets: list[Target]

    @staticmethod
    def build(model: torch.nn.Module, names: list[str]) -> "Plan":
        """The plan for these checkpoint names on this vLLM model; raises NotPlannable."""
        fused_into = {}  # checkpoint module suffix -> (fused suffix, index)
        for fused, parts in (getattr(type(model), "packed_modules_mapping", None) or {}).items():
            for index, part in enumerate(parts):
                fused_into[part] = (fused, index)
        by_module: dict[str, Target] = {}
        slots: dict[tuple[str, str], dict[int, str]] = {}
        for name in names:
            module_name, _, param = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            index = 0
            if leaf in fused_into:
                leaf, index = fused_into[leaf]
                module_name = f"{parent}.{leaf}" if parent else leaf
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                raise NotPlannable(f"{name}: the engine's model has no module {module_name}") from None
            if not hasattr(module, param):
                raise NotPlannable(f"{name}: module {module_name} has no parameter {param}")
            by_module.setdefault(module_name, Target(module_name))
            slots.setdefault((module_name, param), {})[index] = name
        for (module_name, param), indexed in slots.items():
            if sorted(indexed) != list(range(len(indexed))):
                raise NotPlannable(f"{module_name}.{param}: fused parts {sorted(indexed)} are incomplete")
            by_module[module_name].parts[param] = [indexed[i] for i in range(len(indexed))]
        for target in by_module.values():
            module = model.get_submodule(target.module_name)
            if getattr(module, "tp_size", 1) != 1:
                raise NotPlannable(f"{target.module_name} is split across tensor-parallel ranks")
            method = getattr(module, "quant_method", None)
            if method is not None and type(method).__name__ not in ("UnquantizedLinearMethod",
                                                                    "UnquantizedEmbeddingMethod"):
                raise NotPlannable(f"{target.module_name} is quantized ({type(method).__name__})")
        return Plan(frozenset(names), list(by_module.values()))


def _expected_shape(module: torch.nn.Module, param: str, current: torch.Tensor) -> tuple[int, ...]:
    """The shape the parameter had when loaded: a linear layer's packed-away matrix is
    (output, input) of this rank, its bias (output,)."""
    if current.numel() == 0 and hasattr(module, "output_size_per_partition"):
        out, inp = module.output_size_per_partition, module.input_size_per_partition
        return (out, inp) if param == "weight" else (out,)
    return tuple(current.shape)


class InPlaceReload:
    """Reloads a vLLM CPU model's weights by copying and repacking (see the module doc)."""

    def __init__(self) -> None:
        self._plan: Plan | None = None
        self.refused: str | None = None  # why the in-place path is off for this engine
        self._fused: torch.Tensor | None = None  # the staging buffer of fused matrices (bytes)

    def __call__(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
        """Loads `weights` (checkpoint names, every weight of the model) into `model`;
        False, with nothing changed, when the model's layout is not one this path knows.
        Shapes are checked for every tensor before the first one is written."""
        if self.refused is not None:
            return False
        try:
            if self._plan is None or self._plan.names != frozenset(weights):
                self._plan = Plan.build(model, list(weights))
            staged = self._staged(model, weights)
        except NotPlannable as exc:
            self.refused = str(exc)
            return False
        with torch.no_grad():
            for module, params in staged:
                for param, tensors in params:
                    self._load(module, param, tensors)
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)
                self._own(module, [t for _, tensors in params for t in tensors])
        return True

    def _own(self, module: torch.nn.Module, received: list[torch.Tensor]) -> None:
        """After packing, the module must hold nothing of the received tensors (the
        publisher reuses that memory for its next version) nor of the staging buffer: where
        no kernel packing took a copy of its own (a dtype the kernel does not pack falls
        back to a plain matmul over the weight as it was given), the weight is copied."""
        theirs = {t.untyped_storage().data_ptr() for t in received}
        for name, p in list(module.named_parameters(recurse=False)):
            if p.numel() and p.untyped_storage().data_ptr() in theirs:
                setattr(module, name, torch.nn.Parameter(p.detach().clone(), requires_grad=False))
            elif self._fused is not None and self._holds(p):
                self._fused = None  # the module computes with it: it is the module's now

    def _load(self, module: torch.nn.Module, param: str, tensors: list[torch.Tensor]) -> None:
        current = getattr(module, param)
        if current.numel() == 0:  # packed away: the kernel packing takes a fresh matrix
            value = tensors[0] if len(tensors) == 1 else self._fuse(tensors, param)
            setattr(module, param, torch.nn.Parameter(value.to(current.dtype).contiguous(), requires_grad=False))
            return
        value = tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)
        if tuple(current.shape) == tuple(value.shape):
            current.data.copy_(value)
        else:  # an embedding padded to a multiple of its block: padding rows zero, as vLLM leaves them
            current.data[: value.shape[0]].copy_(value)
            current.data[value.shape[0]:].zero_()

    def _fuse(self, tensors: list[torch.Tensor], param: str) -> torch.Tensor:
        """The fused matrix, in the staging buffer (a bias: a tensor of its own, since the
        packed module keeps computing with it)."""
        rows = sum(t.shape[0] for t in tensors)
        shape, dtype = (rows, *tensors[0].shape[1:]), tensors[0].dtype
        if param != "weight":
            return torch.cat(tensors, 0)
        nbytes = rows * tensors[0][0].numel() * dtype.itemsize
        if self._fused is None or self._fused.numel() < nbytes:
            self._fused = torch.empty(nbytes, dtype=torch.uint8)
        out = self._fused[:nbytes].view(dtype).view(shape)
        torch.cat(tensors, 0, out=out)
        return out

    def _holds(self, tensor: torch.Tensor) -> bool:
        if self._fused is None:
            return False
        start = self._fused.data_ptr()
        return tensor.numel() > 0 and start <= tensor.data_ptr() < start + self._fused.numel()

    def _staged(self, model: torch.nn.Module,
                weights: dict[str, torch.Tensor]) -> list[tuple[torch.nn.Module, list[tuple[str, list[torch.Tensor]]]]]:
        """Per module of the plan, its parameters and the tensors that fill each (in fused
        order); raises NotPlannable if any shape does not fit."""
        assert self._plan is not None  # built before staging
        staged = []
        for target in self._plan.targets:
            module = model.get_submodule(target.module_name)
            params = []
            for param, names in target.parts.items():
                tensors = [weights[n] for n in names]
                current = getattr(module, param)
                expected = _expected_shape(module, param, current)
                shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
                fits = shape == expected or (
                    len(names) == 1 and tensors[0].ndim == len(expected) and shape[1:] == expected[1:]
                    and shape[0] < expected[0] and current.numel() > 0)
                if not fits or any(t.shape[1:] != tensors[0].shape[1:] or t.dtype != tensors[0].dtype for t in tensors):
                    raise NotPlannable(f"{target.module_name}.{param}: got {shape} for a parameter of shape {expected}")
                params.append((param, tensors))
            staged.append((module, params))
        return staged
