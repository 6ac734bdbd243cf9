"""Weight loads that run inside each of a vLLM engine's workers.

An engine with tensor parallelism runs one worker process per rank; the process that
drives it (the rollout worker) only schedules. Handing those workers tensors through
vLLM's `collective_rpc` pickles them: by value, CUDA tensors included, every rank a full
copy through vLLM's message queue. Here each worker receives the published bucket itself,
through a parameter channel of its own (mapping the shm segment or the CUDA IPC memory,
pulling over tcp, or taking its own rank of the NCCL broadcast), and loads its shard of
every weight from it. What crosses `collective_rpc` is a `PublishedLoad`: the handle and
settings, msgpack bytes of a few kilobytes whatever the model's size.

A load is two calls so that a failed receive changes no worker: `flexmarl_receive` on
every worker (each receives and verifies, and keeps the verified tensors), then
`flexmarl_apply` on every worker if all received, else `flexmarl_drop`.

`WeightReceiver` is vLLM's worker extension (`worker_extension_cls`): vLLM adds it to its
worker class, so these methods run with the worker as `self`, in every worker process (in
the driving process itself for a one-rank engine). `load_into_worker` is the one way
tensors go into an engine's model, for these loads and for tensors the driving process
already holds (`VllmEngine.load_weights`).

A cancel reaches a receive running in another process as a file: the driving process
creates `cancel_dir/KEY` (the publication's unique key, so a cancel can never touch a later
publication of the same version) and the worker's channel polls for it.

It knows vLLM's worker (its model runner, rank, reload) and the parameter channel; nothing
about agents beyond the names in a handle, the controller or the protocol's messages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import msgspec
import torch

from flexmarl.runtime.params.types import ParamChannelConfig, ParamHandle

log = logging.getLogger("flexmarl.engine")

__all__ = ["Outcome", "PublishedLoad", "WeightReceiver", "cancel_mark", "load_into_worker", "raise_failures",
           "without_tied_head"]

# Checkpoint names of a tied output head and the input embedding it shares its matrix with
# (Llama, Qwen2, Mistral, Qwen3, Gemma all use these names).
TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


class PublishedLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Driving process -> each engine worker: receive and load this publication."""

    handle: ParamHandle
    rank: int = 0  # nccl: the engine's first rank in the broadcast; worker r takes rank + r
    config: ParamChannelConfig = ParamChannelConfig()
    cancel_dir: str = ""  # where a cancel of this receive appears as a file (cancel_mark)
    tied: bool = False  # the model ties its output head to its input embedding
    inplace: bool = True  # a CPU engine may copy into its model (engine_reload.py)


def cancel_mark(cancel_dir: str, key: str) -> str:
    """The file whose existence cancels the receive of the publication `key`."""
    return os.path.join(cancel_dir, key.replace(os.sep, "_"))


class WeightReceiver:
    """vLLM's worker extension: every worker of an engine runs these on `collective_rpc`.

    None of them raises: each returns its outcome (`Outcome`), because vLLM's executor
    stops reading the workers' replies at the first failure, leaving the other workers'
    replies to be taken for the next call's."""

    def flexmarl_receive(self, request: bytes) -> Outcome:
        """Receive and verify the publication; kept until apply or drop. Its bytes, done."""
        try:
            load = msgspec.msgpack.decode(request, type=PublishedLoad)
            rank = load.rank + (getattr(self, "rank", 0) or 0) if load.rank else None
            self.__dict__["_flexmarl_receiving"] = load.handle.key  # what a cancel mark names
            tensors = _worker_channel(self, load).receive(load.handle, rank=rank)
            _staged(self)[load.handle.key] = (load, tensors)
            return Outcome(True, str(load.handle.total_bytes))
        except Exception as exc:  # noqa: BLE001  (returned, see the class doc)
            return Outcome.failed(exc)

    def flexmarl_apply(self, key: str) -> Outcome:
        """Load what `flexmarl_receive` staged under `key` into the model, then let it go.
        Done: how ("in place" or "vllm"), and, where the in-place path is off, why."""
        staged = _staged(self).pop(key, None)
        if staged is None:
            return Outcome(False, "RuntimeError", f"nothing was received under {key!r} in this worker")
        load, tensors = staged
        try:
            return _load(self, tensors.items(), load.tied, load.inplace)
        finally:
            del tensors, staged
            _worker_channel(self, load).release(load.handle)

    def flexmarl_drop(self, key: str) -> Outcome:
        """Let a staged publication go unloaded (another worker's receive failed)."""
        staged = _staged(self).pop(key, None)
        if staged is not None:
            load = staged[0]
            del staged  # the views go before the channel lets their memory go
            _worker_channel(self, load).release(load.handle)
        return Outcome(True)

    def flexmarl_load_tensors(self, weights: list[tuple[str, torch.Tensor]], tied: bool,
                              inplace: bool) -> Outcome:
        """Load tensors handed over with the call (VllmEngine.load_weights)."""
        return _load(self, weights, tied, inplace)

    def flexmarl_close_channel(self) -> Outcome:
        """Unmap and free what this worker's channel holds (the engine is closing)."""
        made = self.__dict__.pop("_flexmarl_channel", None)
        self.__dict__.pop("_flexmarl_staged", None)
        if made is not None:
            made[1].close()
        return Outcome(True)


class Outcome(msgspec.Struct, frozen=True, array_like=True):
    """One worker's reply: done (with what it reports) or failed (the exception's class
    name and message)."""

    ok: bool
    value: str = ""
    detail: str = ""

    @classmethod
    def failed(cls, exc: BaseException) -> Outcome:
        log.exception("engine worker: %s", exc)
        return cls(False, type(exc).__name__, str(exc))


def raise_failures(outcomes: list[Outcome], what: str) -> list[Outcome]:
    """The outcomes, if all are done; else raises the first failure as its own kind where
    that kind says something to the caller (a bad transfer, a refused set)."""
    from flexmarl.runtime.params.types import ParamTransferError

    kinds = {"ParamTransferError": ParamTransferError, "ValueError": ValueError}
    for rank, outcome in enumerate(outcomes):
        if not outcome.ok:
            suffix = f" (engine worker {rank} of {len(outcomes)})" if len(outcomes) > 1 else ""
            raise kinds.get(outcome.value, RuntimeError)(f"{what}: {outcome.detail}{suffix}")
    return outcomes


def _load(worker: Any, weights: Iterable[tuple[str, torch.Tensor]], tied: bool, inplace: bool) -> Outcome:
    """load_into_worker, as an outcome."""
    try:
        how, why = load_into_worker(worker, weights, tied=tied, inplace=inplace)
        return Outcome(True, how, why or "")
    except Exception as exc:  # noqa: BLE001  (returned, see WeightReceiver)
        return Outcome.failed(exc)


def _staged(worker: Any) -> dict[str, tuple[PublishedLoad, dict[str, torch.Tensor]]]:
    return worker.__dict__.setdefault("_flexmarl_staged", {})


def _worker_channel(worker: Any, load: PublishedLoad) -> Any:
    """This worker's channel end, made on first use (again if the settings change)."""
    from flexmarl.runtime.params.channel import ParamChannel
    from flexmarl.runtime.params.types import Location

    made = worker.__dict__.get("_flexmarl_channel")
    if made is None or made[0] != (load.config, load.cancel_dir):
        if made is not None:
            made[1].close()
        device = str(getattr(worker, "device", "cpu"))
        cancel_dir = load.cancel_dir

        def cancelled(agent: str, version: int) -> bool:  # one receive at a time per worker
            key = worker.__dict__.get("_flexmarl_receiving", "")
            return bool(key) and os.path.exists(cancel_mark(cancel_dir, key))

        made = (load.config, load.cancel_dir), ParamChannel(load.config, location=Location.here(device),
                                                            cancelled=cancelled if cancel_dir else None)
        worker.__dict__["_flexmarl_channel"] = made
    return made[1]


def load_into_worker(worker: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], *, tied: bool,
                     inplace: bool = True) -> tuple[str, str | None]:
    """Replace the worker's model weights from checkpoint names and tensors (a complete
    set, already checked against the model's names and shapes); returns how it went ("in
    place" or "vllm") and why the in-place path is off, if it is. A CPU engine of one rank
    copies into its model where the layout allows (engine_reload.py); anything else goes
    through vLLM's reload, which shards each weight for this worker's rank."""
    from .engine_reload import InPlaceReload

    weights = list(named_tensors)
    if tied:
        weights = without_tied_head(weights)
    model = worker.model_runner.get_model()
    on_cpu = next(model.parameters()).device.type == "cpu"
    config = getattr(worker, "vllm_config", None)
    one_rank = config is None or config.parallel_config.world_size == 1  # the plan knows whole weights only
    reload = worker.__dict__.get("_flexmarl_inplace")
    if reload is None and inplace and on_cpu and one_rank:
        reload = worker.__dict__["_flexmarl_inplace"] = InPlaceReload()
    if reload is not None and reload(model, dict(weights)):
        how = "in place"
    else:
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        how = "vllm"
    if tied:
        refresh_tied_head(model)
    return how, reload.refused if reload is not None else None


def refresh_tied_head(model: torch.nn.Module) -> None:
    """Re-derive a tied output head's kernel-side state from the new embedding matrix.

    vLLM reloads layer by layer and rebuilds a layer's derived copies (on CPU, a matrix
    repacked for the matmul kernel) only when that layer is given a weight. A tied head is
    never given one (its weight arrives as the embedding's), so without this it would go on
    computing logits from the old matrix. Rebuilding is idempotent; on GPU it is a no-op."""
    head = model.get_submodule(TIED_HEAD.rpartition(".")[0])
    embedding = model.get_submodule(TIED_EMBEDDING.rpartition(".")[0])
    if head.weight is not embedding.weight:
        raise RuntimeError("the engine's output head is no longer tied to its input embedding "
                           "after a weight reload; restart the engine (LoadModel)")
    head.quant_method.process_weights_after_loading(head)


def without_tied_head(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The weights of a tied-embedding model minus the head's alias of the embedding.

    Dropped rather than loaded: vLLM's loader skips a tied alias anyway, so a head that
    differed from the embedding would be ignored without a word; it is refused instead,
    because it means the sender's model is not tied the way this one is."""
    by_name = dict(weights)
    head, embedding = by_name.get(TIED_HEAD), by_name.get(TIED_EMBEDDING)
    if head is None:
        return weights
    same = embedding is not None and (
        (head.data_ptr() == embedding.data_ptr() and head.shape == embedding.shape)
        or torch.equal(head, embedding))
    if embedding is not None and not same:
        raise ValueError(f"this model ties {TIED_HEAD} to {TIED_EMBEDDING}, but the two given "
                         "differ (was the sender's model built untied?); the engine keeps its "
                         "previous weights")
    return [(name, tensor) for name, tensor in weights if name != TIED_HEAD]
