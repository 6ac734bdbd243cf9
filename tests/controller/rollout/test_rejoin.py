"""Rejoining with a fake server: a rollout worker back after dying gets an agent, its
engine and the agent's current weights before any request is routed to it; a trainer
back goes to the allocator; workers joining during set-up are kept until set-up opens their
role, and then only those set-up did not take itself (a process registered again while it ran)."""

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

    def loop(self):
        return asyncio.get_running_loop()

    def next_request_id(self):
        self._id += 1
        return self._id

    def request(self, worker, msg):  # sent at once, as the server's: the call's task started now
        return asyncio.ensure_future(self.call(worker, msg))

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


async def test_a_live_worker_whose_admission_failed_is_admitted_again_and_counts_as_on_its_way(monkeypatch):
    from flexmarl.controller.control.server import RemoteError
    from flexmarl.controller.rollout import rejoin as rejoining

    monkeypatch.setattr(rejoining, "RETRY_S", 0.05)
    server, client, _, rejoin, _, _ = setup(synced={"solver": 3})
    client.died("r1")
    failures = [RemoteError("r1: LoadWeights for solver failed: the publisher exited")]
    answer = server.call

    async def call(worker, msg, buffers=(), timeout=None):
        if isinstance(msg, protocol.LoadWeights) and failures:
            raise failures.pop()
        return await answer(worker, msg, buffers, timeout)

    server.call = call
    rejoin.finished = lambda: bool(client.instances("solver"))
    rejoin.joined(types.SimpleNamespace(worker_id="r1", role="rollout"))
    seen_pending = []
    loop = asyncio.create_task(rejoin.run())
    while not loop.done():
        seen_pending.append(rejoin.pending())
        await asyncio.sleep(0.01)
    await loop
    assert client.instances("solver") == ["r1"] and client.holds("r1", "solver") == 3
    assert all(seen_pending[:-1]), "between its failed admission and the next, nothing said it was on its way"
    assert rejoin.attempts["r1"] == 1


async def test_a_live_worker_that_fails_every_admission_is_left_idle_after_the_last(monkeypatch):
    from flexmarl.controller.control.server import RemoteError
    from flexmarl.controller.rollout import rejoin as rejoining

    monkeypatch.setattr(rejoining, "RETRY_S", 0.01)
    server, client, _, rejoin, _, _ = setup(synced={"solver": 3})
    client.died("r1")

    async def refuses(worker, msg, buffers=(), timeout=None):
        raise RemoteError("r1: cannot load")

    server.call = refuses
    rejoin.joined(types.SimpleNamespace(worker_id="r1", role="rollout"))
    for _ in range(200):
        if rejoin.attempts.get("r1") == rejoining.ADMISSION_ATTEMPTS and not rejoin.pending():
            break
        if not rejoin.queue.empty():
            worker = rejoin.queue.get_nowait()
            if await rejoin.serve(worker) is None:
                rejoin._again(worker)
        await asyncio.sleep(0.01)
    assert rejoin.attempts["r1"] == rejoining.ADMISSION_ATTEMPTS and not rejoin.pending()
    assert client.instances("solver") == []


async def test_joins_during_set_up_are_taken_once_their_role_opens_unless_set_up_took_them_itself():
    server, _, _, rejoin, _, trainers = setup(accepting=False)
    placed = dict(server.registry.workers)  # the registrations set-up takes
    for info in placed.values():
        rejoin.joined(info)
    again = {w: types.SimpleNamespace(**{**vars(placed[w]), "pid": 99}) for w in ("r1", "t0")}
    for worker, info in again.items():  # died at set-up, and the next process registered
        placed[worker].alive = False
        server.registry.workers[worker] = info
        rejoin.joined(info)
    assert rejoin.queue.empty() and trainers == []
    rejoin.open(placed, "trainer")
    assert trainers == ["t0"] and rejoin.queue.empty()
    rejoin.open(placed, "rollout")
    assert rejoin.queue.get_nowait() == "r1" and rejoin.queue.empty() and trainers == ["t0"]


async def test_a_replacement_that_died_again_before_set_up_ended_is_not_taken():
    server, _, _, rejoin, _, _ = setup(accepting=False)
    placed = dict(server.registry.workers)
    placed["r1"].alive = False
    gone = types.SimpleNamespace(**{**vars(placed["r1"]), "pid": 99, "alive": True})
    server.registry.workers["r1"] = gone
    rejoin.joined(gone)
    gone.alive = False  # its next registration will be taken when it comes
    rejoin.open(placed, "rollout")
    assert rejoin.queue.empty()


async def test_an_admission_whose_worker_registered_again_meanwhile_fails():
    server, client, _, rejoin, _, _ = setup()
    client.died("r1")
    answer = server.call

    async def call(worker, msg, buffers=(), timeout=None):
        reply = await answer(worker, msg, buffers, timeout)
        if isinstance(msg, protocol.LoadModel):  # the engine started, then the process died and came back
            server.registry.workers[worker] = types.SimpleNamespace(**{**vars(server.registry.workers[worker]),
                                                                       "pid": 99})
        return reply

    server.call = call
    assert await rejoin.admission.admit("r1", "solver") is False
    assert client.instances("solver") == [], "routed to a process that holds no engine"
