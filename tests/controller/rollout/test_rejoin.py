"""Rejoining with a fake server: a rollout worker back after dying gets an agent, its
engine and the agent's current weights before any request is routed to it; a trainer
back goes to the allocator; workers joining during set-up are left alone."""

import asyncio
import types

from flexmarl.controller.control.server import WorkerDied
from flexmarl.controller.rollout.admission import Admission
from flexmarl.controller.rollout.rejoin import Rejoin, choose_unit
from flexmarl.controller.state.instances import RolloutInstances
from flexmarl.controller.state.versions import SyncedVersions
from flexmarl.controller.weights.sync import Publication, WeightSync
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.bases import whole_models

AGENTS = ["planner", "solver"]
HANDLE = object()  # the controller never looks inside a handle


class FakeServer:
    def __init__(self, workers, dies=()):
        infos = {w: types.SimpleNamespace(worker_id=w, role=role, host="h", pid=i + 1, devices=[], alive=True)
                 for i, (w, role) in enumerate(workers.items())}
        self.registry = types.SimpleNamespace(
            workers=infos, alive=lambda role=None: [i for i in infos.values() if i.alive and role in (None, i.role)])
        self.calls, self.dies, self._id = [], set(dies), 0
        self.routable_at_call = []  # was the worker in the rollout assignment when commanded?
        self.client = None

    def next_request_id(self):
        self._id += 1
        return self._id

    async def call(self, worker, msg, buffers=(), timeout=None):
        self.calls.append((worker, type(msg).__name__, getattr(msg, "version", None)))
        if self.client is not None:
            self.routable_at_call.append(worker in self.client.instances(getattr(msg, "agent", "")))
        if worker in self.dies:
            raise WorkerDied(worker, "killed again")
        if isinstance(msg, protocol.PublishWeights):
            return protocol.WeightsPublished(msg.request_id, msg.agent, msg.version, HANDLE, 8, 0.0), []
        if isinstance(msg, protocol.LoadModel):
            return protocol.ModelLoaded(msg.request_id, msg.agent, msg.version, 0.0), []
        return protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version, 0.0), []


def setup(dies=(), accepting=True, synced=None):
    server = FakeServer({"r0": "rollout", "r1": "rollout", "t0": "trainer"}, dies)
    events = []
    instances = RolloutInstances(whole_models(AGENTS), events.append)
    for worker, agent in (("r0", "planner"), ("r1", "solver")):
        instances.engine_started(worker, agent, 0)
        instances.serve(worker, agent, "placed by the test")
    events.clear()
    server.client = instances
    versions = SyncedVersions(AGENTS)
    weights = WeightSync(AGENTS, server, instances, versions, events.append)
    for agent, version in (synced or {}).items():
        versions.set(agent, version)
        weights.published[agent] = Publication(version, HANDLE, "shm")
    admission = Admission(instances, weights, versions, server,
                          lambda agent: protocol.LoadModel(server.next_request_id(), agent, f"/models/{agent}", 0))
    trainers = []
    rejoin = Rejoin(whole_models(AGENTS), instances, admission, server,
                    accepting=lambda: accepting, finished=lambda: False, trainer_joined=trainers.append)
    return server, instances, weights, rejoin, events, trainers


def test_the_unit_with_the_fewest_instances_is_chosen_the_one_served_before_on_a_tie():
    assert choose_unit({"planner": 1, "solver": 0, "checker": 0}, "checker") == "checker"
    assert choose_unit({"planner": 1, "solver": 0, "checker": 0}, None) == "solver"
    assert choose_unit({"planner": 1, "solver": 0, "checker": 0}, "planner") == "solver"


async def test_a_rollout_worker_back_after_dying_serves_its_agent_at_the_synced_version_before_any_request():
    server, client, weights, rejoin, events, _ = setup(synced={"solver": 4})
    client.loaded("r1", "solver", 4)  # what the dead process held: the new one holds nothing
    client.died("r1")  # the solver's only instance
    assert await rejoin.serve("r1") == "solver"
    assert server.calls == [("r1", "LoadModel", 0), ("r1", "LoadWeights", 4)]
    assert server.routable_at_call == [False, False], "routed to before it held the current weights"
    assert client.instances("solver") == ["r1"] and client.holds("r1", "solver") == 4
    changes = [e.why for e in events if isinstance(e, ev.AllocationChanged)]
    assert changes == ["r1 died", "r1 rejoined"]
    assert [(w, a) for w, a, _ in rejoin.rejoined] == [("r1", "solver")]


async def test_an_agent_still_at_version_0_needs_only_its_model():
    server, client, _, rejoin, _, _ = setup()
    client.died("r0")
    assert await rejoin.serve("r0") == "planner"
    assert server.calls == [("r0", "LoadModel", 0)]


async def test_no_weight_sync_of_the_agent_runs_between_the_load_and_the_join():
    server, client, weights, rejoin, _, _ = setup(synced={"solver": 2})
    client.died("r1")
    async with weights.locks["solver"]:  # a sync of the solver is under way
        task = asyncio.create_task(rejoin.serve("r1"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert server.calls == [("r1", "LoadModel", 0)]  # the engine starts meanwhile ...
        assert client.instances("solver") == []  # ... but it joins only after the sync
    assert await task == "solver"
    assert client.instances("solver") == ["r1"]


async def test_a_worker_that_dies_again_while_rejoining_is_not_routed_to():
    server, client, _, rejoin, _, _ = setup(dies={"r1"})
    client.died("r1")
    assert await rejoin.serve("r1") is None
    assert client.instances("solver") == [] and rejoin.rejoined == []


async def test_joins_during_set_up_are_ignored_and_a_trainer_goes_back_to_the_allocator():
    _, _, _, early, _, trainers = setup(accepting=False)
    for worker, role in (("r0", "rollout"), ("t0", "trainer")):
        early.joined(types.SimpleNamespace(worker_id=worker, role=role))
    assert early.queue.empty() and trainers == []

    _, _, _, rejoin, _, trainers = setup()
    rejoin.joined(types.SimpleNamespace(worker_id="t0", role="trainer"))
    rejoin.joined(types.SimpleNamespace(worker_id="env-0", role="env"))  # the environment client's, not ours
    rejoin.joined(types.SimpleNamespace(worker_id="r1", role="rollout"))
    assert trainers == ["t0"] and rejoin.queue.get_nowait() == "r1" and rejoin.queue.empty()


async def test_the_loop_serves_queued_workers_and_ends_once_every_batch_is_trained():
    server, client, _, rejoin, _, _ = setup()
    client.died("r1")
    rejoin.finished = lambda: bool(client.instances("solver"))  # "trained" once the worker is back
    rejoin.joined(types.SimpleNamespace(worker_id="r1", role="rollout"))
    await asyncio.wait_for(rejoin.run(), 5)
    assert [(w, a) for w, a, _ in rejoin.rejoined] == [("r1", "solver")] and rejoin.queue.empty()
