"""Decoupled PPO's proximal policy on a trainer: the agent's weights one version back.

An agent trained with `off_policy = "decoupled"` (and a staleness bound above 0) keeps,
beside its live weights, a copy of them as they were before its last optimizer step
(`PreviousWeights.keep`, called by the step): the weights of the version before the one
being trained. Scoring a micro-batch under them puts the copy in the parameters' place for
the span of a `with` (`in_place`: the tensors swapped, nothing copied) and back; a tied
head is one parameter, swapped once; an adapter agent's parameters are its adapter, so
its copy is the adapter alone.

The copy lives where the weights do. It is not part of the training state the channel
parks, checkpoints or moves: an agent loaded on another trainer, or resumed, has no
previous version until its next step, and its first micro-batches take the trained
weights as their proximal policy (each importance ratio u then 1).

It knows torch and a model's named parameters; nothing of versions, losses or commands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class PreviousWeights:
    """A copy of a model's parameters as they were before its last optimizer step."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] | None = None

    def keep(self, model: Any) -> None:
        """The model's weights now (called right before a step changes them), copied into
        the tensors of the last copy where there is one."""
        with torch.no_grad():
            if self.tensors is None:
                self.tensors = {name: p.detach().clone() for name, p in model.named_parameters()}
            else:
                for name, p in model.named_parameters():
                    self.tensors[name].copy_(p.detach())

    @contextlib.contextmanager
    def in_place(self, model: Any) -> Iterator[None]:
        """The model computes with the copy inside the `with` (no gradient may be taken
        through it); its own weights are back after, whatever happens inside."""
        assert self.tensors is not None, "no previous version is kept"
        params = list(model.named_parameters())
        own = [p.data for _, p in params]
        try:
            for name, p in params:
                p.data = self.tensors[name]
            yield
        finally:
            for (_, p), data in zip(params, own):
                p.data = data

    def to(self, device: Any) -> None:
        """Moves the copy (to host memory while its agent is parked on a GPU trainer, and back)."""
        if self.tensors is not None:
            self.tensors = {name: t.to(device) for name, t in self.tensors.items()}
