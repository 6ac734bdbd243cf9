"""Weight sync: an agent's trainer publishes its weights, every rollout instance of the
agent loads them, worker to worker; the controller only passes the handle.

`WeightSync.sync(agent, trainer, version)` consumes a stepped agent and produces every
live instance of the agent at `version` (for an adapter agent: every instance of its base,
each sent the adapter alone, LoadWeights with `lora`) (recorded with the instances' owner,
state/instances.py), then sets the agent's synced version (state/versions.py; the schedule's gate and
producer wait on it). Per agent it holds the sync lock (held while a version is
published and loaded, so an instance joining the agent never loads a handle the trainer
is about to release, and no sync runs in the middle of a join) and the agent's newest
publication (version, handle, transport). The transport is chosen by
`transport_between` from where the two ends are (host, process, device). Over NCCL the
sync names the agent's communicator and each instance's rank (`NcclGroups`): one
communicator per agent, from its trainer to all its instances, reused while they stay.

`stepping(agent)` is held around the agent's optimizer step, which ends its publication
(a trainer on the CPU publishes its weights where they live, and the step changes them):
no load runs meanwhile, and the handle is forgotten.

`load_newest(worker, agent)` loads the newest publication into one instance (for the
admission, rollout/admission.py); if the handle was released (the trainer parked the agent, which
frees its published weights: `forget`), was an NCCL broadcast (over by then), or is older
than the synced version (a resume), the trainer publishes again, through `trainer_for`,
whatever version it holds then.

It does not decide when to sync (the pipeline does) or which instances serve an agent
(the instances' owner).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncContextManager, Callable, Collection, Protocol

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.params.types import Location, ParamHandle, choose_transport, host_device

from ..control.interfaces import Emit, WorkerServer
from ..control.server import WorkerDied
from ..state.versions import SyncedVersions
from .nccl_groups import NcclGroups

log = logging.getLogger("flexmarl.weight_sync")


def location_of(worker: Any) -> Location:
    """Where a registered worker's parameters live: its host, process and first device,
    a GPU named as its host names it. A worker pinned with CUDA_VISIBLE_DEVICES=2,3 calls
    its first GPU cuda:0, which is the host's cuda:2 (or the GPU's UUID, where the pinning
    gives one): two workers' cuda:0 are one GPU only if they were pinned to the same one."""
    return locations_of(worker, 1)[0]


def locations_of(worker: Any, ranks: int) -> list[Location]:
    """Where each of the first `ranks` ranks of a worker's engine receives: on its first
    `ranks` GPUs (vLLM puts engine worker r on the r-th GPU it sees), or all on the CPU."""
    devices = [d for d in worker.devices if d.startswith("cuda")] or ["cpu"]
    pinned = getattr(worker, "visible_gpus", [])
    return [Location(worker.host, worker.pid, host_device(devices[min(r, len(devices) - 1)], pinned))
            for r in range(ranks)]


def engines_sharing_gpu(worker: str, workers: dict[str, Any]) -> int:
    """How many live rollout workers (`worker` included) compute on the GPU `worker` computes
    on: they split the GPU's share between their engines. 1 for a worker on the CPU."""
    me = workers.get(worker)
    if me is None or not me.devices or not me.devices[0].startswith("cuda"):
        return 1
    here = location_of(me)
    gpu = (here.host, here.device)
    sharing = [location_of(w) for w in workers.values() if w.alive and w.role == "rollout" and w.devices]
    return max(1, sum(1 for end in sharing if (end.host, end.device) == gpu))


def transport_between(src: Location, dsts: list[Location]) -> str:
    """One transport that serves every receiver of a publication: the pair choice when all
    receivers agree, NCCL when every end is on a GPU of its own (NCCL refuses two ranks on
    one GPU), else host memory: shared on one host, TCP across hosts."""
    chosen = {choose_transport(src, d) for d in dsts}
    if len(chosen) == 1 and chosen != {"nccl"}:
        return chosen.pop()
    gpus = [(end.host, end.device) for end in (src, *dsts)]
    if chosen == {"nccl"} and len(set(gpus)) == len(gpus):
        return "nccl"
    return "shm" if all(d.host == src.host for d in dsts) else "tcp"


@dataclass(frozen=True)
class Publication:
    """An agent's newest published weights."""

    version: int
    handle: ParamHandle
    transport: str


class ServedInstances(Protocol):
    """What the weight sync needs of the rollout instances (instances.RolloutInstances, the
    owner of who holds which version): who serves an agent, and word that one loaded it."""

    def instances(self, agent: str) -> list[str]: ...

    def loaded(self, worker: str, agent: str, version: int) -> None: ...


class WeightSync:
    def __init__(self, agents: list[str], server: WorkerServer, instances: ServedInstances,
                 versions: SyncedVersions, emit: Emit,
                 trainer_for: Callable[[str], AsyncContextManager[str]] | None = None,
                 lora: dict[str, protocol.LoraSettings | None] | None = None,
                 ranks: dict[str, int] | None = None, in_flight: str = "finish") -> None:
        self.server = server
        # What a load does to the requests in flight on an instance (LoadWeights.in_flight);
        # an adapter's load never waits for them (its requests keep their version).
        self.in_flight = in_flight
        # Per agent, the workers of each of its engines (tensor parallelism): each receives
        # the weights itself, so each is a receiving rank of its own. Default 1.
        self.ranks = ranks or {}
        # An adapter agent's LoRA shape: its LoadWeights adds the adapter's new version to
        # the engines of its base instead of replacing their weights.
        self.lora = lora or {}
        self.instances = instances
        self.versions = versions  # set(agent, version) once every instance loaded it
        self.trainer_for = trainer_for or _no_trainer
        self.emit = emit
        self.locks = {a: asyncio.Lock() for a in agents}
        self.published: dict[str, Publication] = {}
        self.groups = NcclGroups()

    def transport(self, trainer: str, instances: list[str], agent: str = "") -> str:
        workers = self.server.registry.workers
        width = self.ranks.get(agent, 1)
        return transport_between(location_of(workers[trainer]),
                                 [end for w in instances for end in locations_of(workers[w], width)])

    async def sync(self, agent: str, trainer: str, version: int) -> None:
        async with self.locks[agent]:
            lost_ranks: set[str] = set()
            while True:  # ends: each round that loses a rank has one instance fewer to lose
                try:
                    await self._publish_and_load(agent, trainer, version, without=lost_ranks)
                    break
                except _BroadcastLostARank as lost:
                    # The others could never have received it: again, over a new group of the
                    # instances still serving the agent (the dead have left them).
                    log.warning("%s died during the NCCL weight sync of %s version %d; %s cancelled, "
                                "published again without it", ", ".join(lost.dead), agent, version,
                                ", ".join(lost.cancelled) or "no other receive")
                    lost_ranks.update(lost.dead)
            self.versions.set(agent, version)

    async def _publish_and_load(self, agent: str, trainer: str, version: int, without: Collection[str] = frozenset()) -> None:
        instances = [w for w in self.instances.instances(agent) if w not in without]
        t0 = time.monotonic()
        transport = self.transport(trainer, instances, agent)
        width = self.ranks.get(agent, 1)
        group, ranks = "", {w: 0 for w in instances}
        if transport == "nccl":
            nccl = self.groups.for_sync(agent, trainer, instances, width)
            group, instances = nccl.name, list(nccl.instances)  # targets in rank order
            ranks = {w: nccl.rank(w) for w in instances}
        self.emit(ev.WeightSyncStarted(agent, version, list(instances), transport=transport))
        loads: dict[str, asyncio.Future] = {}
        try:
            reply, _ = await self.server.call(trainer, protocol.PublishWeights(
                self.server.next_request_id(), agent, version, transport, instances, group, width))
            loads = {w: asyncio.ensure_future(self.server.call(w, protocol.LoadWeights(
                self.server.next_request_id(), agent, version, reply.handle, ranks[w], self.lora.get(agent),
                self.in_flight))) for w in instances}
            cancelled = await self._cancel_if_a_rank_dies(agent, reply.handle, loads) if group else []
            results = await asyncio.gather(*loads.values(), return_exceptions=True)
        except BaseException:
            self.groups.drop(agent)
            for load in loads.values():  # none is left running (or failing) unseen
                load.cancel()
            await asyncio.gather(*loads.values(), return_exceptions=True)
            raise
        if group and any(isinstance(r, BaseException) for r in results):
            self.groups.drop(agent)  # a broadcast some rank left is in no known state
        dead = [w for w, r in zip(instances, results) if isinstance(r, WorkerDied)]
        if group and dead and any(isinstance(r, BaseException) and not isinstance(r, WorkerDied) for r in results):
            raise _BroadcastLostARank(dead, cancelled)
        for worker, result in zip(instances, results):
            if isinstance(result, WorkerDied):
                log.warning("%s died during the weight sync of %s; it leaves the agent", worker, agent)
            elif isinstance(result, BaseException):
                raise result
            else:
                self.instances.loaded(worker, agent, version)
        self.published[agent] = Publication(version, reply.handle, transport)
        self.emit(ev.WeightSyncFinished(agent, version, time.monotonic() - t0, reply.nbytes))

    async def _cancel_if_a_rank_dies(self, agent: str, handle: ParamHandle,
                                     loads: dict[str, asyncio.Future]) -> list[str]:
        """Over NCCL every receiver waits for every other: one that dies would hold the rest
        until their set-up wait runs out. When one dies, the others are told to give up the
        publication `handle` (CancelLoad names its key: a retry of the same version is
        another publication, never touched); the instances told, in order."""
        pending = set(loads.values())
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(not f.cancelled() and isinstance(f.exception(), WorkerDied) for f in done):
                break
        else:
            return []
        waiting = [w for w, f in loads.items() if not f.done()]
        await asyncio.gather(*(self.server.call(w, protocol.CancelLoad(self.server.next_request_id(), agent, handle.key))
                               for w in waiting), return_exceptions=True)  # a cancel that fails changes nothing
        return waiting

    def forget(self, agent: str) -> None:
        """The agent's published weights were released (its trainer parked it): the handle
        must never be sent again."""
        self.published.pop(agent, None)

    @contextlib.asynccontextmanager
    async def stepping(self, agent: str):
        """Held around the agent's optimizer step: the trainer ends the agent's publication
        with it (its weights may be that publication, and change in place), so no load of
        it may be running (the sync lock) and its handle is never sent again."""
        async with self.locks[agent]:
            self.forget(agent)
            yield

    async def load_newest(self, worker: str, agent: str) -> int:
        """Loads `agent`'s newest weights into `worker`, publishing them again where the last
        publication cannot be read (see the module doc); the version loaded, never older
        than the synced one. The caller holds the agent's lock (no sync runs in between)."""
        pub = self.published.get(agent)
        # An NCCL publication was a broadcast to the ranks of its time: it cannot be read again.
        if pub is None or pub.transport == "nccl" or pub.version < self.versions[agent]:
            pub = await self._republish(agent, worker)
        rank = 1 if pub.transport == "nccl" else 0
        await self.server.call(worker, protocol.LoadWeights(self.server.next_request_id(), agent, pub.version,
                                                            pub.handle, rank, self.lora.get(agent), self.in_flight))
        return pub.version

    async def _republish(self, agent: str, worker: str) -> Publication:
        """Publishes, for one instance, the version the agent's trainer holds now: the synced
        one, or a newer one when the agent stepped and its sync waits for this lock (over
        NCCL, a one-shot broadcast to it alone: the agent's group is for its instances at
        the last sync)."""
        async with self.trainer_for(agent) as trainer:
            transport = self.transport(trainer, [worker], agent)
            reply, _ = await self.server.call(trainer, protocol.PublishWeights(
                self.server.next_request_id(), agent, protocol.CURRENT_VERSION, transport, [worker],
                ranks_per_target=self.ranks.get(agent, 1)))
        self.published[agent] = pub = Publication(reply.version, reply.handle, transport)
        log.info("published %s version %d again for %s (%s)", agent, reply.version, worker,
                 "an NCCL broadcast is read once" if transport == "nccl" else "no readable publication")
        return pub


class _BroadcastLostARank(Exception):
    """An NCCL sync in which an instance died: the other receivers were cancelled."""

    def __init__(self, dead: list[str], cancelled: list[str]) -> None:
        super().__init__(f"{dead} died during an NCCL broadcast")
        self.dead, self.cancelled = dead, cancelled


@contextlib.asynccontextmanager
async def _no_trainer(agent: str):
    raise RuntimeError(f"the weights of {agent} were released and no trainer can publish them again")
    yield  # pragma: no cover
