"""The weight-sync component with a fake server: publish once, load on every instance,
transport chosen from where the ends are, an instance dying mid-sync leaves the agent."""

import asyncio
import types

import pytest

from flexmarl.controller.control.server import RemoteError, WorkerDied
from flexmarl.controller.state.versions import SyncedVersions
from flexmarl.controller.weights.sync import WeightSync, engines_sharing_gpu, location_of, transport_between
from flexmarl.runtime import protocol
from flexmarl.runtime.params.types import Location


class FakeServer:
    def __init__(self, hosts: dict[str, str], devices: dict[str, str] | None = None, dies=(), fails=()):
        devices = devices or {}
        self.registry = types.SimpleNamespace(workers={
            w: types.SimpleNamespace(host=h, pid=i + 1, devices=[devices[w]] if w in devices else [])
            for i, (w, h) in enumerate(hosts.items())})
        self.calls, self.dies, self.fails, self._id = [], set(dies), set(fails), 0
        self.trainer_at = 0

    def next_request_id(self):
        self._id += 1
        return self._id

    def request(self, worker, msg):  # sent at once, as the server's: the call's task started now
        return asyncio.ensure_future(self.call(worker, msg))

    async def call(self, worker, msg, buffers=(), timeout=None):
        self.calls.append((worker, msg))
        if worker in self.dies:
            raise WorkerDied(worker, "killed")
        if worker in self.fails:
            raise RemoteError(f"{worker} refused")
        if isinstance(msg, protocol.PublishWeights):  # the trainer is at the last version it was asked for
            if msg.version != protocol.CURRENT_VERSION:
                self.trainer_at = msg.version
            return protocol.WeightsPublished(msg.request_id, msg.agent, self.trainer_at,
                                             fake_handle(msg.agent, self.trainer_at, msg.request_id), 1024, 0.0), []
        return protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version, 0.0), []


def fake_handle(agent, version, n):
    """The controller never looks inside a handle but for its key, which names one publication."""
    return types.SimpleNamespace(key=f"{agent}-v{version}-pub{n}")


class Instances:
    """The instances' owner as the weight sync sees it: who serves the agent, what each loaded."""

    def __init__(self, serving):
        self.serving, self.held = serving, {}

    def instances(self, agent):
        return list(self.serving)

    def loaded(self, worker, agent, version):
        self.held[worker] = (agent, version)


def weight_sync(server, serving, events=None, **kw):
    versions = SyncedVersions(["a"])
    ws = WeightSync(["a"], server, Instances(serving), versions, (events if events is not None else []).append, **kw)
    return ws, versions


def test_the_transport_follows_where_the_ends_are():
    t, same, other = Location("h1", 1), Location("h1", 2), Location("h2", 3)
    assert transport_between(t, [same]) == "shm"
    assert transport_between(t, [other]) == "tcp"
    assert transport_between(t, [same, other]) == "tcp"  # one handle must reach both
    g, g2 = Location("h1", 1, "cuda:0"), Location("h2", 2, "cuda:0")
    assert transport_between(g, [Location("h1", 2, "cuda:0")]) == "cuda_ipc"  # the same GPU
    assert transport_between(g, [Location("h1", 2, "cuda:1")]) == "nccl"  # another GPU of the host
    assert transport_between(g, [g2, Location("h1", 2, "cuda:1")]) == "nccl"
    # NCCL wants a GPU per rank: one receiver on the trainer's GPU, or two sharing one,
    # and the publication goes through host memory
    assert transport_between(g, [g2, Location("h1", 2, "cuda:0")]) == "tcp"
    assert transport_between(g, [Location("h1", 2, "cuda:1"), Location("h1", 3, "cuda:1")]) == "shm"
    assert transport_between(t, [t, same]) == "shm"  # shm reaches a receiver in the publisher's process too


async def test_a_sync_publishes_once_loads_every_instance_and_then_reports_the_version():
    server = FakeServer({"t0": "h", "r0": "h", "r1": "h"})
    ws, versions = weight_sync(server, ["r0", "r1"])
    await ws.sync("a", "t0", 3)
    kinds = [(w, type(m).__name__) for w, m in server.calls]
    assert kinds == [("t0", "PublishWeights"), ("r0", "LoadWeights"), ("r1", "LoadWeights")]
    assert server.calls[0][1].transport == "shm"
    assert versions["a"] == 3
    assert ws.instances.held == {"r0": ("a", 3), "r1": ("a", 3)}


async def test_a_sync_sends_every_load_at_once_without_a_task_per_instance():
    # At 1,024 instances a task per LoadWeights cost the controller more than the message:
    # each load is a request's future, all of them sent in the sync's own turn.
    class AtOnce(FakeServer):
        def request(self, worker, msg):
            self.calls.append((worker, msg))
            answered = asyncio.get_running_loop().create_future()
            answered.set_result((protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version, 0.0), []))
            return answered

    instances = [f"r{i}" for i in range(16)]
    server = AtOnce({"t0": "h", **{w: "h" for w in instances}})
    ws, versions = weight_sync(server, instances)
    loop, tasks = asyncio.get_running_loop(), []
    factory = loop.get_task_factory()

    def counted(loop, coro, **kw):
        tasks.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(counted)
    try:
        await ws.sync("a", "t0", 1)
    finally:
        loop.set_task_factory(factory)
    assert [w for w, m in server.calls if isinstance(m, protocol.LoadWeights)] == instances
    assert tasks == []
    assert versions["a"] == 1 and ws.instances.held == {w: ("a", 1) for w in instances}


async def test_an_instance_that_dies_during_a_sync_is_left_out_and_the_sync_completes():
    server = FakeServer({"t0": "h", "r0": "h", "r1": "h"}, dies={"r1"})
    ws, versions = weight_sync(server, ["r0", "r1"])
    await ws.sync("a", "t0", 1)
    assert ws.instances.held == {"r0": ("a", 1)} and versions["a"] == 1


async def test_an_instance_refusing_the_weights_fails_the_sync_and_reports_no_version():
    server = FakeServer({"t0": "h", "r0": "h"}, fails={"r0"})
    ws, versions = weight_sync(server, ["r0"])
    with pytest.raises(RemoteError):
        await ws.sync("a", "t0", 1)
    assert versions["a"] == 0


async def test_a_sync_waits_for_the_agents_lock():
    server = FakeServer({"t0": "h", "r0": "h"})
    ws, _ = weight_sync(server, ["r0"])
    await ws.locks["a"].acquire()
    task = asyncio.ensure_future(ws.sync("a", "t0", 1))
    await asyncio.sleep(0.01)
    assert server.calls == []
    ws.locks["a"].release()
    await asyncio.wait_for(task, 1)
    assert len(server.calls) == 2


# --- over NCCL: one communicator per agent, named and ranked by the controller -----------

def gpu_server(instances=("r0", "r1"), **kw):
    """A trainer and instances on GPUs of different hosts: weight sync goes over NCCL."""
    hosts = {"t0": "h0", **{w: f"h{i + 1}" for i, w in enumerate(instances)}}
    return FakeServer(hosts, devices={w: "cuda:0" for w in hosts}, **kw)


def nccl_sync(server, instances, events=None):
    current = list(instances)
    ws, _ = weight_sync(server, current, events, trainer_for=lambda agent: _trainer("t0"))
    return ws, current


def _trainer(name):
    import contextlib

    @contextlib.asynccontextmanager
    async def bound():
        yield name
    return bound()


def calls_of(server, kind):
    return [(w, m) for w, m in server.calls if isinstance(m, kind)]


async def test_over_nccl_the_trainer_is_told_the_group_and_each_instance_its_rank():
    server, events = gpu_server(), []
    ws, _ = nccl_sync(server, ["r0", "r1"], events)
    await ws.sync("a", "t0", 1)
    (_, publish), = calls_of(server, protocol.PublishWeights)
    assert publish.transport == "nccl" and publish.group and publish.targets == ["r0", "r1"]
    assert {w: m.rank for w, m in calls_of(server, protocol.LoadWeights)} == {"r0": 1, "r1": 2}
    assert events[0].transport == "nccl"  # the event log says which transport a sync used


async def test_an_agents_group_is_reused_while_its_instances_stay_and_replaced_when_they_change():
    server = gpu_server(("r0", "r1", "r2"))
    ws, current = nccl_sync(server, ["r0", "r1"])
    await ws.sync("a", "t0", 1)
    await ws.sync("a", "t0", 2)
    current[:] = ["r1", "r0"]  # the same members in another order: still the same communicator
    await ws.sync("a", "t0", 3)
    groups = [m.group for _, m in calls_of(server, protocol.PublishWeights)]
    assert groups[0] == groups[1] == groups[2]
    loads = calls_of(server, protocol.LoadWeights)
    assert {(w, m.rank) for w, m in loads[4:]} == {("r0", 1), ("r1", 2)}  # ranks stay with the group
    current[:] = ["r0", "r1", "r2"]
    await ws.sync("a", "t0", 4)
    fourth = calls_of(server, protocol.PublishWeights)[-1][1]
    assert fourth.group != groups[0] and fourth.targets == ["r0", "r1", "r2"]
    assert [m.rank for _, m in calls_of(server, protocol.LoadWeights)[-3:]] == [1, 2, 3]


async def test_a_sync_an_instance_died_in_leaves_the_group_to_be_made_again():
    server = gpu_server(dies={"r1"})
    ws, current = nccl_sync(server, ["r0", "r1"])
    await ws.sync("a", "t0", 1)
    first = calls_of(server, protocol.PublishWeights)[0][1].group
    assert ws.groups.current("a") is None
    server.dies.clear()
    await ws.sync("a", "t0", 2)  # same members, but the old communicator is in no known state
    assert calls_of(server, protocol.PublishWeights)[1][1].group not in ("", first)


async def test_a_refused_nccl_load_fails_the_sync_and_drops_the_group():
    server = gpu_server(fails={"r0"})
    ws, _ = nccl_sync(server, ["r0", "r1"])
    with pytest.raises(RemoteError):
        await ws.sync("a", "t0", 1)
    assert ws.groups.current("a") is None


async def test_an_instance_joining_after_an_nccl_sync_gets_a_broadcast_of_its_own():
    server = gpu_server(("r0", "r1", "r2"))
    ws, _ = nccl_sync(server, ["r0", "r1"])
    await ws.sync("a", "t0", 1)
    group = ws.groups.current("a")
    async with ws.locks["a"]:
        assert await ws.load_newest("r2", "a") == 1
    _, again = calls_of(server, protocol.PublishWeights)[-1]
    assert (again.transport, again.group, again.targets, again.version) == ("nccl", "", ["r2"],
                                                                           protocol.CURRENT_VERSION)
    _, load = calls_of(server, protocol.LoadWeights)[-1]
    assert load.rank == 1 and load.version == 1
    assert ws.groups.current("a") == group  # the agent's communicator is untouched


def tp_server(instances=("r0", "r1"), gpus_per_instance=2):
    """Instances whose engines span two GPUs each (tensor parallelism), on other hosts."""
    server = gpu_server(instances)
    for w in instances:
        server.registry.workers[w].devices = [f"cuda:{g}" for g in range(gpus_per_instance)]
    return server


async def test_over_nccl_each_worker_of_an_instances_engine_is_a_rank_of_its_own():
    """An engine of two ranks receives in both of its workers: the instance takes two
    consecutive ranks, and the trainer's broadcast counts all of them."""
    server = tp_server()
    ws, _ = nccl_sync(server, ["r0", "r1"])
    ws.ranks = {"a": 2}
    await ws.sync("a", "t0", 1)
    (_, publish), = calls_of(server, protocol.PublishWeights)
    assert publish.transport == "nccl" and publish.ranks_per_target == 2 and publish.targets == ["r0", "r1"]
    assert {w: m.rank for w, m in calls_of(server, protocol.LoadWeights)} == {"r0": 1, "r1": 3}
    assert ws.groups.current("a").receivers == 4
    await ws.sync("a", "t0", 2)  # same members, same width: the same communicator
    assert len({m.group for _, m in calls_of(server, protocol.PublishWeights)}) == 1
    async with ws.locks["a"]:  # a one-shot broadcast to one joining instance counts its ranks too
        await ws.load_newest("r1", "a")
    assert calls_of(server, protocol.PublishWeights)[-1][1].ranks_per_target == 2


def test_an_engine_whose_second_rank_shares_the_trainers_gpu_gets_host_memory_not_nccl():
    server = FakeServer({"t0": "h", "r0": "h"}, devices={"t0": "cuda:1"})
    server.registry.workers["r0"].devices = ["cuda:0", "cuda:1"]  # rank 1 on the trainer's GPU
    ws, _ = weight_sync(server, ["r0"], ranks={"a": 2})
    assert ws.transport("t0", ["r0"], "a") == "shm"
    assert ws.transport("t0", ["r0"]) == "nccl"  # one rank only: its GPU is its own


async def test_over_shm_no_group_or_rank_is_handed_out():
    server = FakeServer({"t0": "h", "r0": "h"})
    ws, _ = weight_sync(server, ["r0"])
    await ws.sync("a", "t0", 1)
    assert calls_of(server, protocol.PublishWeights)[0][1].group == ""
    assert calls_of(server, protocol.LoadWeights)[0][1].rank == 0


def test_an_agent_left_without_instances_still_publishes_over_host_memory():
    # Its only instance died and is being restarted: the sync publishes for later loaders.
    from flexmarl.controller.weights.sync import transport_between
    from flexmarl.runtime.params.types import Location

    assert transport_between(Location("h", 1, "cpu"), []) == "shm"
    assert transport_between(Location("h", 1, "cuda:0"), []) == "shm"


def test_pinned_workers_are_placed_on_the_gpus_their_host_numbers_not_their_own_cuda_0():
    """The layout of docs/operations.md, "GPUs and precision": the trainer pinned to GPUs 2-3, rollouts to 0 and to 1. Each
    calls its first GPU cuda:0; they share none, so CUDA IPC cannot reach them: NCCL."""
    from types import SimpleNamespace

    def worker(pid, pinned, host="h1"):
        return SimpleNamespace(host=host, pid=pid, devices=[f"cuda:{i}" for i in range(len(pinned))],
                               visible_gpus=pinned)

    trainer, r0, r1 = worker(1, ["2", "3"]), worker(2, ["0"]), worker(3, ["1"])
    assert location_of(trainer).device == "cuda:2" and location_of(r1).device == "cuda:1"
    assert transport_between(location_of(trainer), [location_of(r0), location_of(r1)]) == "nccl"
    beside = worker(4, ["2"])  # pinned to the trainer's own GPU
    assert transport_between(location_of(trainer), [location_of(beside)]) == "cuda_ipc"
    by_uuid = worker(5, ["GPU-5b3c"])
    assert location_of(by_uuid).device == "cuda:GPU-5b3c"
    far = worker(6, ["2"], host="h2")  # the same number on another host is another GPU
    assert transport_between(location_of(trainer), [location_of(far)]) == "nccl"
    unpinned = SimpleNamespace(host="h1", pid=7, devices=["cuda:0", "cuda:1"], visible_gpus=[])
    assert location_of(unpinned).device == "cuda:0"


def test_rollout_workers_on_one_gpu_are_counted_so_their_engines_split_it():
    from types import SimpleNamespace

    def worker(pid, pinned, role="rollout", devices=None, alive=True, host="h1"):
        return SimpleNamespace(host=host, pid=pid, role=role, alive=alive, visible_gpus=pinned,
                               devices=devices if devices is not None else ["cuda:0"])

    workers = {"r0": worker(1, []), "r1": worker(2, []),  # unpinned: both on the host's GPU 0
               "r2": worker(3, ["1"]), "r3": worker(4, ["0"]),  # pinned: to GPU 1, and to GPU 0 too
               "t": worker(5, []  , role="trainer"), "gone": worker(6, [], alive=False),
               "far": worker(7, [], host="h2"), "cpu": worker(8, [], devices=["cpu"])}
    assert engines_sharing_gpu("r0", workers) == 3  # r0, r1 and r3; trainers and dead workers not
    assert engines_sharing_gpu("r2", workers) == 1
    assert engines_sharing_gpu("far", workers) == 1 and engines_sharing_gpu("cpu", workers) == 1


class DyingRankServer(FakeServer):
    """Over NCCL, r1 dies while r0 waits for it to join the group: r0's receive ends only
    when it is told to give up (CancelLoad), as a real receiver's would."""

    def __init__(self):
        super().__init__({"t0": "h0", "r0": "h1", "r1": "h2"}, devices={w: "cuda:0" for w in ("t0", "r0", "r1")})
        self.cancel = asyncio.Event()
        self.first_load_of_r0 = True

    async def call(self, worker, msg, buffers=(), timeout=None):
        if isinstance(msg, protocol.CancelLoad):
            self.calls.append((worker, msg))
            self.cancel.set()
            return protocol.LoadCancelled(msg.request_id, msg.agent), []
        if isinstance(msg, protocol.LoadWeights) and worker == "r1":
            self.calls.append((worker, msg))
            await asyncio.sleep(0.01)  # r0 is already waiting in the group's set-up
            raise WorkerDied(worker, "killed")
        if isinstance(msg, protocol.LoadWeights) and worker == "r0" and self.first_load_of_r0:
            self.first_load_of_r0 = False
            self.calls.append((worker, msg))
            await self.cancel.wait()
            raise RemoteError("LoadWeights for a failed: the NCCL group was cancelled (another rank died)")
        return await super().call(worker, msg, buffers, timeout)


async def test_a_rank_dying_in_an_nccl_sync_cancels_the_others_and_the_sync_completes_without_it():
    server = DyingRankServer()
    ws, _ = nccl_sync(server, ["r0", "r1"])
    await asyncio.wait_for(ws.sync("a", "t0", 1), 10)  # without the cancel, r0 would wait forever
    (who, cancel), = calls_of(server, protocol.CancelLoad)
    loads = [m for w, m in calls_of(server, protocol.LoadWeights) if w == "r0"]
    assert who == "r0" and cancel.agent == "a" and cancel.key == loads[0].handle.key != loads[1].handle.key
    first, again = [m for _, m in calls_of(server, protocol.PublishWeights)]
    assert first.targets == ["r0", "r1"] and again.targets == ["r0"] and again.group != first.group
    assert ws.versions["a"] == 1 and ws.instances.held == {"r0": ("a", 1)}


async def test_an_adapter_loads_late_cancel_spares_the_retry_of_the_same_version():
    """An adapter agent's NCCL sync loses r1; r0 is told to give up the first publication.
    That cancel reaching r0 only while it receives the retry (the same agent and version,
    published again without r1) must not cancel the retry."""
    from flexmarl.workers.rollout.worker import RolloutHandler

    server = DyingRankServer()
    ws, _ = nccl_sync(server, ["r0", "r1"])
    ws.lora = {"a": protocol.LoraSettings(8)}
    await asyncio.wait_for(ws.sync("a", "t0", 1), 10)
    (_, cancel), = calls_of(server, protocol.CancelLoad)
    first, retry = [m for w, m in calls_of(server, protocol.LoadWeights) if w == "r0"]
    assert retry.lora is not None and (retry.agent, retry.version) == (first.agent, first.version)

    handler, cancelled = RolloutHandler(), []
    handler.session = types.SimpleNamespace(send=lambda msg, buffers=(): asyncio.sleep(0))
    handler._channel = types.SimpleNamespace(cancel=lambda *publication: cancelled.append(publication))
    handler._applying = retry  # r0 is receiving the retry when the late cancel arrives
    await handler.handle(cancel, [])
    assert cancelled == [], "the cancel of the first publication cancelled its retry"


async def test_a_step_waits_for_a_load_of_the_agents_publication_and_the_handle_is_never_sent_again():
    from flexmarl.controller.weights.sync import Publication

    ws = WeightSync(["a"], None, None, SyncedVersions(["a"]), lambda e: None)
    ws.published["a"] = Publication(2, "handle-a2", "shm")
    stepped = asyncio.Event()

    async def step():
        async with ws.stepping("a"):  # the trainer ends the publication with the step
            stepped.set()

    async with ws.locks["a"]:  # a joining instance loads the publication meanwhile
        task = asyncio.create_task(step())
        await asyncio.sleep(0.01)
        assert not stepped.is_set() and ws.published["a"].handle == "handle-a2"
    await asyncio.wait_for(task, 1)
    assert stepped.is_set() and "a" not in ws.published  # a later join has it published again


async def test_a_publication_dies_with_its_trainers_process_even_when_a_new_trainer_registers_under_its_id():
    import contextlib

    server = FakeServer({"t0": "h1", "r0": "h1", "r1": "h1"})
    workers = server.registry.workers
    for name, info in workers.items():
        info.identity = f"{name}/first".encode()
    server.registry.by_identity = lambda identity: next((w for w in workers.values() if w.identity == identity), None)

    @contextlib.asynccontextmanager
    async def trainer_for(agent):
        yield "t0"  # the trainer holding the agent now: the restarted one

    ws, versions = weight_sync(server, ["r0"], trainer_for=trainer_for)
    await ws.sync("a", "t0", 1)
    assert ws.published["a"].publisher == b"t0/first"
    workers["t0"].identity = b"t0/second"  # its process died; a new one registered as t0
    assert await ws.load_newest("r1", "a") == 1
    publishes = [m for _, m in calls_of(server, protocol.PublishWeights)]
    loads = [m for w, m in calls_of(server, protocol.LoadWeights) if w == "r1"]
    assert [m.version for m in publishes] == [1, protocol.CURRENT_VERSION]  # published again, by the live one
    assert loads[0].handle.key == fake_handle("a", 1, publishes[1].request_id).key
    assert ws.published["a"].publisher == b"t0/second"


class AgentInstances(Instances):
    """Instances per agent (a snapshot's apart from its source's); what each holds per agent."""

    def __init__(self, serving_of):
        super().__init__([])
        self.serving_of, self.held = serving_of, {}

    def instances(self, agent):
        return list(self.serving_of.get(agent, []))

    def loaded(self, worker, agent, version):
        self.held[worker, agent] = version


def snapshot_sync(every=2, hosts=None):
    server = FakeServer(hosts or {"t": "h", "ia": "h", "is": "h"})
    instances = AgentInstances({"a": ["ia"], "s": ["is"]})
    versions = SyncedVersions(["a", "s"])
    events = []
    ws = WeightSync(["a", "s"], server, instances, versions, events.append, snapshots={"s": ("a", every)})
    return ws, server, instances, versions, events


def test_a_snapshot_is_refreshed_by_its_sources_sync_when_due_from_the_same_publication():
    ws, server, instances, versions, events = snapshot_sync(every=2)
    asyncio.run(ws.sync("a", "t", 1))  # not due: a snapshot refreshed every 2 steps
    assert versions["s"] == 0 and ("is", "s") not in instances.held
    server.calls.clear()
    asyncio.run(ws.sync("a", "t", 2))
    publishes = [m for _, m in server.calls if isinstance(m, protocol.PublishWeights)]
    loads = {(w, m.agent): m for w, m in server.calls if isinstance(m, protocol.LoadWeights)}
    assert len(publishes) == 1  # one publication over shm, read by both agents' instances
    assert loads["is", "s"].handle is loads["ia", "a"].handle and loads["is", "s"].version == 2
    assert versions["s"] == 2 and versions["a"] == 2 and instances.held["is", "s"] == 2
    refreshed = [e for e in events if type(e).__name__ == "SnapshotRefreshed"]
    assert [(e.agent, e.source, e.version) for e in refreshed] == [("s", "a", 2)]


def test_a_snapshots_instances_on_another_host_get_a_publication_of_their_own():
    ws, server, instances, versions, _ = snapshot_sync(every=1, hosts={"t": "h", "ia": "h", "is": "other"})
    asyncio.run(ws.sync("a", "t", 1))
    publishes = [m for _, m in server.calls if isinstance(m, protocol.PublishWeights)]
    assert [(m.agent, m.transport, m.targets) for m in publishes] == [("a", "shm", ["ia"]), ("a", "tcp", ["is"])]
    assert versions["s"] == 1 and ws.published["a"].transport == "tcp"  # the trainer's live publication of a


def test_a_snapshot_joining_loads_its_sources_publication_under_its_own_name():
    ws, server, instances, versions, _ = snapshot_sync(every=1)
    asyncio.run(ws.sync("a", "t", 1))
    server.calls.clear()

    async def join():
        async with ws.locks_of("s"):  # the source's lock, then the snapshot's
            assert ws.locks["a"].locked() and ws.locks["s"].locked()
            return await ws.load_newest("is2", "s")

    assert asyncio.run(join()) == 1
    (worker, load), = server.calls
    assert (worker, load.agent, load.version, load.handle) == ("is2", "s", 1, ws.published["a"].handle)


def test_a_frozen_adapter_agent_is_loaded_from_its_directory():
    server = FakeServer({"t": "h", "i": "h"})
    lora = protocol.LoraSettings(rank=8)
    ws = WeightSync(["j"], server, Instances(["i"]), SyncedVersions(["j"]), [].append, lora={"j": lora},
                    adapter_dirs={"j": "/runs/old/checkpoints/final/j"})
    assert asyncio.run(ws.load_newest("i", "j")) == 0
    (_, load), = server.calls
    assert (load.handle, load.adapter_dir, load.lora) == (None, "/runs/old/checkpoints/final/j", lora)


async def test_the_in_flight_setting_rides_on_the_loads_of_a_sync_and_of_a_join_in_its_own_field():
    """pipeline.in_flight reaches every instance's LoadWeights as `in_flight`, never in
    another field (a frozen adapter's directory, `adapter_dir`, stays empty)."""
    server = FakeServer({"t0": "h1", "r0": "h1", "r1": "h1"})
    ws, _ = weight_sync(server, ["r0"], in_flight="keep")
    await ws.sync("a", "t0", 1)
    assert await ws.load_newest("r1", "a") == 1
    loads = [(w, m.version, m.rank, m.lora, m.adapter_dir, m.in_flight) for w, m in calls_of(server, protocol.LoadWeights)]
    assert loads == [("r0", 1, 0, None, "", "keep"), ("r1", 1, 0, None, "", "keep")]
