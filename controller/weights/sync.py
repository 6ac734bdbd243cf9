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
frees its published weights: `forget`), was an NCCL broadcast (over by then), is older
than the synced version (a resume), or its trainer died since (its segments went with its
process, even when a new trainer registered under its id), the trainer holding the agent
publishes again, through `trainer_for`, whatever version it holds then: after a trainer's
death, that is the agent's state restored from its newest intact checkpoint.

A snapshot agent (a frozen copy of another agent, `agents.X.snapshot_of`) is refreshed
by its source's sync when one is due (`decisions.snapshot_version`): its instances load the
source's new version from the same publication where it can be read again (otherwise the
source's trainer publishes it once more for them), under the snapshot's name, and its
synced version becomes the source's; all before the source's synced version moves, so
the next batch never meets a stale snapshot in sync mode. A snapshot's lock is taken after
its source's, always (`locks_of`). A frozen adapter agent is loaded from its directory
(`adapter_dirs`); a frozen whole model is the engine's own weights and never loads any.

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
from ..state import decisions
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
    # The publishing trainer's connection (its registry identity): the bytes live in that
    # process, so the publication dies with it, even if a new trainer registers under its id.
    publisher: bytes = b""


class ServedInstances(Protocol):
    """What the weight sync needs of the rollout instances (instances.RolloutInstances, the
    owner of who holds which version): who serves an agent, and word that one loaded it."""

    def instances(self, agent: str) -> list[str]: ...

    def holds(self, worker: str, agent: str) -> int | None: ...

    def loaded(self, worker: str, agent: str, version: int) -> None: ...


class WeightSync:
    def __init__(self, agents: list[str], server: WorkerServer, instances: ServedInstances,
                 versions: SyncedVersions, emit: Emit,
                 trainer_for: Callable[[str], AsyncContextManager[str]] | None = None,
                 lora: dict[str, protocol.LoraSettings | None] | None = None,
                 ranks: dict[str, int] | None = None, snapshots: dict[str, tuple[str, int]] | None = None,
                 adapter_dirs: dict[str, str] | None = None, in_flight: str = "finish") -> None:
        self.server = server
        # Snapshot agent -> (the agent it copies, its refresh interval in that agent's steps).
        self.snapshots = snapshots or {}
        self.adapter_dirs = adapter_dirs or {}  # frozen adapter agent -> its PEFT directory
        # What a load does to the requests in flight on an instance (LoadWeights.in_flight);
        # an adapter's load never waits for them ("finish": they keep their version; "keep"
        # and "recompute": they move to the new one).
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

    def source_of(self, agent: str) -> str:
        """The agent whose trainer publishes `agent`'s weights: itself, or the one a snapshot copies."""
        return self.snapshots[agent][0] if agent in self.snapshots else agent

    @contextlib.asynccontextmanager
    async def locks_of(self, agent: str):
        """The agent's sync lock, a snapshot's after its source's (the order a sync takes them in)."""
        async with contextlib.AsyncExitStack() as held:
            for a in dict.fromkeys((self.source_of(agent), agent)):
                await held.enter_async_context(self.locks[a])
            yield

    async def sync(self, agent: str, trainer: str, version: int) -> None:
        async with self.locks[agent]:
            await self._with_lost_ranks(agent, trainer, version)
            for snapshot, (source, every) in self.snapshots.items():
                if source == agent and decisions.snapshot_version(version + 1, every) == version:
                    async with self.locks[snapshot]:
                        await self._refresh(snapshot, trainer, version)
            self.versions.set(agent, version)

    async def _with_lost_ranks(self, agent: str, trainer: str, version: int) -> None:
        lost_ranks: set[str] = set()
        while True:  # ends: each round that loses a rank has one instance fewer to lose
            try:
                await self._publish_and_load(agent, trainer, version, without=lost_ranks)
                return
            except _BroadcastLostARank as lost:
                # The others could never have received it: again, over a new group of the
                # instances still serving the agent (the dead have left them).
                log.warning("%s died during the NCCL weight sync of %s version %d; %s cancelled, "
                            "published again without it", ", ".join(lost.dead), agent, version,
                            ", ".join(lost.cancelled) or "no other receive")
                lost_ranks.update(lost.dead)

    async def _refresh(self, snapshot: str, trainer: str, version: int) -> None:
        """The snapshot's instances load its source's `version` (just synced): from the
        source's publication where every one of them can read it again, else published once
        more for them. Its synced version is then the source's."""
        source = self.source_of(snapshot)
        pub, instances = self.published.get(source), self.instances.instances(snapshot)
        if instances:
            if (pub is not None and pub.version == version and pub.transport != "nccl" and self._live(pub)
                    and pub.transport == self.transport(trainer, instances, snapshot)):
                t0 = time.monotonic()
                self.emit(ev.WeightSyncStarted(snapshot, version, list(instances), transport=pub.transport))
                await self._load_each(snapshot, version, pub.handle, {w: 0 for w in instances})
                self.emit(ev.WeightSyncFinished(snapshot, version, time.monotonic() - t0, 0))
            else:
                await self._with_lost_ranks(snapshot, trainer, version)
        self.versions.set(snapshot, version)
        self.emit(ev.SnapshotRefreshed(snapshot, source, version))
        log.info("snapshot %s refreshed to %s version %d", snapshot, source, version)

    async def _load_each(self, agent: str, version: int, handle: ParamHandle, ranks: dict[str, int]) -> None:
        """Every instance of `ranks` loads `handle` as `agent` at `version`; one that dies leaves the agent."""
        results = await asyncio.gather(*(self._load(w, agent, version, handle, rank=rank) for w, rank in ranks.items()),
                                       return_exceptions=True)
        self._loaded(agent, version, list(ranks), results, f"while loading {agent} version {version}")

    def _load(self, worker: str, agent: str, version: int, handle: ParamHandle | None, *, rank: int = 0,
              adapter_dir: str = "", in_flight: str = "") -> asyncio.Future:
        """Has `worker` load `agent`'s weights at `version` (every field of LoadWeights named:
        its optional ones are easily given in the wrong place): sent now, the future of its
        reply. A sync sends one to every instance of the agent, each without a task of its own."""
        return self.server.request(worker, protocol.LoadWeights(
            request_id=self.server.next_request_id(), agent=agent, version=version, handle=handle, rank=rank,
            lora=self.lora.get(agent), adapter_dir=adapter_dir, in_flight=in_flight))

    def _loaded(self, agent: str, version: int, workers: list[str], results: list[Any], during: str) -> None:
        """Each worker's load result: loaded, or dead (it leaves the agent; said `during` what);
        any other failure is raised."""
        for worker, result in zip(workers, results):
            if isinstance(result, WorkerDied):
                log.warning("%s died %s; it leaves the agent", worker, during)
            elif isinstance(result, BaseException):
                raise result
            else:
                self.instances.loaded(worker, agent, version)

    async def _publish_and_load(self, agent: str, trainer: str, version: int, without: Collection[str] = frozenset()) -> None:
        instances = [w for w in self.instances.instances(agent) if w not in without]
        source = self.source_of(agent)  # a snapshot's weights are its source's, published by its trainer
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
                self.server.next_request_id(), source, version, transport, instances, group, width))
            loads = {w: self._load(w, agent, version, reply.handle, rank=ranks[w], in_flight=self.in_flight)
                     for w in instances}
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
        self._loaded(agent, version, instances, results, f"during the weight sync of {agent}")
        self.published[source] = Publication(version, reply.handle, transport,  # the trainer's one live publication of it
                                             self._identity(trainer))
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

    async def catch_up(self, agent: str, trainer: str, version: int) -> None:
        """After the agent's state was restored and trained again up to `version` (the synced
        one): an instance admitted meanwhile was loaded with what the trainer held then, an
        older version; every instance is brought to `version` by a sync of it. Nothing is
        sent when all hold it already."""
        behind = [w for w in self.instances.instances(agent) if (self.instances.holds(w, agent) or 0) < version]
        if behind:
            log.info("%s held %s at an older version than %d after its trainer was restored; syncing them",
                     ", ".join(behind), agent, version)
            await self.sync(agent, trainer, version)

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

    def readable(self, agent: str) -> bool:
        """Whether `load_newest` of `agent` reads the last publication as it is (no publishing
        again), for any number of instances at once: one from a live trainer, not an NCCL
        broadcast, at the synced version or newer; or a frozen adapter's directory. (An NCCL
        publication was a broadcast to the ranks of its time: it cannot be read again; one
        whose trainer died went with its process, a restarted trainer holds nothing of it.)"""
        if agent in self.adapter_dirs:
            return True
        pub = self.published.get(self.source_of(agent))
        return (pub is not None and pub.transport != "nccl" and pub.version >= self.versions[agent]
                and self._live(pub))

    async def load_newest(self, worker: str, agent: str) -> int:
        """Loads `agent`'s newest weights into `worker`, publishing them again where the last
        publication cannot be read (see the module doc); the version loaded, never older
        than the synced one. The caller holds the agent's locks (`locks_of`: no sync runs
        in between). A snapshot loads its source's publication under its own name: its
        synced version where that can still be read, else its source's version now, newer
        (the source's trainer holds no older weights); a frozen adapter its directory."""
        if agent in self.adapter_dirs:
            await self._load(worker, agent, 0, None, adapter_dir=self.adapter_dirs[agent])
            return 0
        source = self.source_of(agent)
        pub = self.published[source] if self.readable(agent) else await self._republish(source, worker)
        if source != agent and pub.version != self.versions[agent]:
            log.warning("%s joins snapshot %s at %s version %d, not its synced %d (no older weights are held)",
                        worker, agent, source, pub.version, self.versions[agent])
        rank = 1 if pub.transport == "nccl" else 0
        await self._load(worker, agent, pub.version, pub.handle, rank=rank, in_flight=self.in_flight)
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
        self.published[agent] = pub = Publication(reply.version, reply.handle, transport, self._identity(trainer))
        log.info("published %s version %d again for %s (%s)", agent, reply.version, worker,
                 "an NCCL broadcast is read once" if transport == "nccl" else "no readable publication")
        return pub

    def _identity(self, trainer: str) -> bytes:
        info = self.server.registry.workers.get(trainer)
        return getattr(info, "identity", b"")  # b"": a publisher not known by connection is taken as live

    def _live(self, pub: Publication) -> bool:
        """Whether the process that published `pub` is still the one registered: a
        publication outlives neither its trainer's death nor its re-registration."""
        return not pub.publisher or self.server.registry.by_identity(pub.publisher) is not None


class _BroadcastLostARank(Exception):
    """An NCCL sync in which an instance died: the other receivers were cancelled."""

    def __init__(self, dead: list[str], cancelled: list[str]) -> None:
        super().__init__(f"{dead} died during an NCCL broadcast")
        self.dead, self.cancelled = dead, cancelled


@contextlib.asynccontextmanager
async def _no_trainer(agent: str):
    raise RuntimeError(f"the weights of {agent} were released and no trainer can publish them again")
    yield  # pragma: no cover
