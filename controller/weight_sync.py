"""Weight sync: an agent's trainer publishes its weights, every rollout instance of the
agent loads them, worker to worker; the controller only passes the handle.

`WeightSync.sync(agent, trainer, version)` consumes a stepped agent and produces every
live instance of the agent at `version`, then reports `on_synced(agent, version)` (the
schedule's gate and producer wait on that). Per agent it holds the sync lock (held while
a version is published and loaded, so an instance joining the agent never loads a handle
the trainer is about to release, and no sync runs in the middle of a join), the handle of
the synced version, and the version each instance holds. The transport is chosen by
`choose_transport` from where the two ends are (host, process, device). Over NCCL the
sync names the agent's communicator and each instance's rank (`NcclGroups`): one
communicator per agent, from its trainer to all its instances, reused while they stay.

An instance that (re)joins an agent between syncs is brought to the agent's synced
version by `bring_up_to_date`; if the handle was released meanwhile (the trainer parked
the agent, which frees its published weights: `forget`), or was an NCCL broadcast (over
by then), the weights are published again from the agent's trainer, obtained through
`trainer_for`.

It does not decide when to sync (the pipeline does) or which instances serve an agent
(the rollout client's assignment, read through `instances`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncContextManager, Callable

import msgspec

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.param_types import Location, ParamHandle, choose_transport, host_device

from .nccl_groups import NcclGroups
from .server import WorkerDied

log = logging.getLogger("flexmarl.weight_sync")


def location_of(worker: Any) -> Location:
    """Where a registered worker's parameters live: its host, process and first device,
    a GPU named as its host names it. A worker pinned with CUDA_VISIBLE_DEVICES=2,3 calls
    its first GPU cuda:0, which is the host's cuda:2 (or the GPU's UUID, where the pinning
    gives one): two workers' cuda:0 are one GPU only if they were pinned to the same one."""
    device = worker.devices[0] if worker.devices else "cpu"
    return Location(worker.host, worker.pid, host_device(device, getattr(worker, "visible_gpus", [])))


def engines_sharing_gpu(worker: str, workers: dict[str, Any]) -> int:
    """How many live rollout workers (`worker` included) compute on the GPU `worker` computes
    on: they split the GPU's share between their engines. 1 for a worker on the CPU."""
    me = workers.get(worker)
    if me is None or not me.devices or not me.devices[0].startswith("cuda"):
        return 1
    here = location_of(me)
    return max(1, sum(1 for w in workers.values()
                      if w.alive and w.role == "rollout" and w.devices
                      and (location_of(w).host, location_of(w).device) == (here.host, here.device)))


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


class WeightSync:
    def __init__(self, agents: list[str], server: Any, instances: Callable[[str], list[str]],
                 emit: Callable[[ev.Event], Any], on_synced: Callable[[str, int], None],
                 trainer_for: Callable[[str], AsyncContextManager[str]] | None = None) -> None:
        self.server = server  # call(), next_request_id(), registry.workers
        self.instances = instances
        self.trainer_for = trainer_for or _no_trainer
        self.emit = emit
        self.on_synced = on_synced
        self.locks = {a: asyncio.Lock() for a in agents}
        self.synced = {a: 0 for a in agents}
        self.published: dict[str, ParamHandle] = {}  # agent -> handle of its synced version
        self.published_over: dict[str, str] = {}  # agent -> that handle's transport
        self.groups = NcclGroups()
        self.holds: dict[str, tuple[str, int]] = {}  # instance -> (agent, version) it serves

    def transport(self, trainer: str, instances: list[str]) -> str:
        workers = self.server.registry.workers
        return transport_between(location_of(workers[trainer]), [location_of(workers[w]) for w in instances])

    async def sync(self, agent: str, trainer: str, version: int) -> None:
        async with self.locks[agent]:
            await self._publish_and_load(agent, trainer, version)
        self.on_synced(agent, version)

    async def _publish_and_load(self, agent: str, trainer: str, version: int) -> None:
        instances = self.instances(agent)
        t0 = time.monotonic()
        transport = self.transport(trainer, instances)
        group, ranks = "", {w: 0 for w in instances}
        if transport == "nccl":
            nccl = self.groups.for_sync(agent, trainer, instances)
            group, instances = nccl.name, list(nccl.instances)  # targets in rank order
            ranks = {w: nccl.rank(w) for w in instances}
        self.emit(ev.WeightSyncStarted(agent, version, list(instances), transport=transport))
        try:
            reply, _ = await self.server.call(trainer, protocol.PublishWeights(
                self.server.next_request_id(), agent, version, transport, instances, group))
            results = await asyncio.gather(*(self.server.call(w, protocol.LoadWeights(
                self.server.next_request_id(), agent, version, reply.handle, ranks[w])) for w in instances),
                return_exceptions=True)
        except BaseException:
            self.groups.drop(agent)
            raise
        if group and any(isinstance(r, BaseException) for r in results):
            self.groups.drop(agent)  # a broadcast some rank left is in no known state
        for worker, result in zip(instances, results):
            if isinstance(result, WorkerDied):
                log.warning("%s died during the weight sync of %s; it leaves the agent", worker, agent)
            elif isinstance(result, BaseException):
                raise result
            else:
                self.holds[worker] = (agent, version)
        self.published[agent], self.published_over[agent] = reply.handle, transport
        self.synced[agent] = version
        self.emit(ev.WeightSyncFinished(agent, version, time.monotonic() - t0, reply.nbytes))

    async def start_engine(self, worker: str, message: protocol.LoadModel) -> Any:
        """(Re)starts `worker`'s engine with `message` and records the version it now serves;
        the reply is returned."""
        shared = engines_sharing_gpu(worker, self.server.registry.workers)
        if shared != message.engine.engines_on_gpu:
            engine = msgspec.structs.replace(message.engine, engines_on_gpu=shared)
            message = msgspec.structs.replace(message, engine=engine)
        reply, _ = await self.server.call(worker, message)
        self.served(worker, message.agent, message.version)
        return reply

    def served(self, worker: str, agent: str, version: int) -> None:
        """Records that `worker` now serves `agent` at `version` (a join or a restart)."""
        self.holds[worker] = (agent, version)

    def forget(self, agent: str) -> None:
        """The agent's published weights were released (its trainer parked it): the handle
        must never be sent again."""
        self.published.pop(agent, None)
        self.published_over.pop(agent, None)

    async def bring_up_to_date(self, worker: str, agent: str) -> None:
        """Loads `agent`'s synced weights into `worker` unless it holds them already. The
        caller holds the agent's lock (no sync can run in between)."""
        version = self.synced[agent]
        if self.holds.get(worker) == (agent, version):
            return
        handle = self.published.get(agent)
        # An NCCL publication was a broadcast to the ranks of its time: it cannot be read again.
        if handle is None or self.published_over.get(agent) == "nccl":
            handle = await self._republish(agent, worker)
        rank = 1 if self.published_over.get(agent) == "nccl" else 0
        await self.server.call(worker, protocol.LoadWeights(self.server.next_request_id(), agent, version, handle,
                                                            rank))
        self.holds[worker] = (agent, version)

    async def _republish(self, agent: str, worker: str) -> Any:
        """Publishes the synced version again for one instance (over NCCL, a one-shot
        broadcast to it alone: the agent's group is for its instances at the last sync)."""
        async with self.trainer_for(agent) as trainer:
            transport = self.transport(trainer, [worker])
            reply, _ = await self.server.call(trainer, protocol.PublishWeights(
                self.server.next_request_id(), agent, self.synced[agent], transport, [worker]))
        self.published[agent], self.published_over[agent] = reply.handle, transport
        log.info("published %s version %d again for %s (%s)", agent, self.synced[agent], worker,
                 "an NCCL broadcast is read once" if transport == "nccl" else "the last publication was released")
        return reply.handle


@contextlib.asynccontextmanager
async def _no_trainer(agent: str):
    raise RuntimeError(f"the weights of {agent} were released and no trainer can publish them again")
    yield  # pragma: no cover
