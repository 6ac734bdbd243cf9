"""Instances of a base shared by its adapter agents, with fake workers: admission loads the
base once and each agent's adapter from its trainer; routing of an adapter agent spreads
over every instance of its base by the load of all its agents; a sync sends the adapter
alone (LoadWeights with lora) to every instance of the base; each group carries the
agent's synced version; rejoin and balancing move instances between engine units, never
between agents of one base."""

import asyncio
import contextlib
import types

from fake_rollout import FakeServer as StreamingServer
from fake_rollout import until

from flexmarl.controller.rollout.admission import Admission
from flexmarl.controller.rollout.balance_loop import Rebalancer
from flexmarl.controller.rollout.rejoin import Rejoin
from flexmarl.controller.rollout.router import RolloutClient
from flexmarl.controller.state.instances import RolloutInstances
from flexmarl.controller.state.versions import SyncedVersions
from flexmarl.controller.weights.sync import WeightSync
from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey
from flexmarl.runtime.bases import EngineUnit
from flexmarl.runtime.config import RouterConfig

AGENTS = ["whole", "a", "b", "c"]
BASE_ENGINE = protocol.EngineSettings(max_loras=3, max_lora_rank=8, max_cpu_loras=3)
UNITS = {"whole": EngineUnit("whole", ("whole",)),
         "bases.shared": EngineUnit("bases.shared", ("a", "b", "c"), lora=True, settings=BASE_ENGINE)}
LORA = protocol.LoraSettings(8)
HANDLE = object()


class FakeServer:
    def __init__(self, workers):
        infos = {w: types.SimpleNamespace(worker_id=w, role=role, host="h", pid=i + 1, devices=[], alive=True, load={})
                 for i, (w, role) in enumerate(workers.items())}
        self.registry = types.SimpleNamespace(
            workers=infos, alive=lambda role=None: [i for i in infos.values() if i.alive and role in (None, i.role)])
        self.calls, self._id = [], 0

    def loop(self):
        return asyncio.get_running_loop()

    def next_request_id(self):
        self._id += 1
        return self._id

    def request(self, worker, msg):  # sent at once, as the server's: the call's task started now
        return asyncio.ensure_future(self.call(worker, msg))

    async def call(self, worker, msg, buffers=(), timeout=None):
        self.calls.append((worker, type(msg).__name__, msg.agent, getattr(msg, "version", None),
                           getattr(msg, "lora", None) is not None))
        if isinstance(msg, protocol.PublishWeights):
            version = 0 if msg.version == protocol.CURRENT_VERSION else msg.version
            return protocol.WeightsPublished(msg.request_id, msg.agent, version, HANDLE, 8, 0.0), []
        if isinstance(msg, protocol.LoadModel):
            return protocol.ModelLoaded(msg.request_id, msg.agent, msg.version, 0.0), []
        return protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version, 0.0), []


def engine_message(server):
    def message(unit):
        return UNITS[unit].load_message(server.next_request_id(), "/models/whole" if unit == "whole" else "/models/base",
                                        0)
    return message


def cluster(workers=("r0", "r1", "r2")):
    server = FakeServer({**{w: "rollout" for w in workers}, "t0": "trainer"})
    instances = RolloutInstances(UNITS)
    versions = SyncedVersions(AGENTS)

    @contextlib.asynccontextmanager
    async def trainer_for(agent):
        yield "t0"

    weights = WeightSync(AGENTS, server, instances, versions, lambda e: None, trainer_for=trainer_for,
                         lora={a: LORA for a in UNITS["bases.shared"].agents} | {"whole": None})
    admission = Admission(instances, weights, versions, server, engine_message(server))
    return server, instances, versions, weights, admission


async def test_admitting_an_instance_to_a_base_loads_the_base_once_then_every_agents_adapter():
    server, instances, _, _, admission = cluster()
    assert await admission.admit("r1", "bases.shared")
    loads = [(w, kind, agent, lora) for w, kind, agent, _, lora in server.calls if w == "r1"]
    assert loads == [("r1", "LoadModel", "bases.shared", False), ("r1", "LoadWeights", "a", True),
                     ("r1", "LoadWeights", "b", True), ("r1", "LoadWeights", "c", True)]
    # Version 0 of an adapter is its trainer's (the base alone is no agent's weights).
    assert [(agent, v) for w, kind, agent, v, _ in server.calls if kind == "PublishWeights"] == [
        ("a", protocol.CURRENT_VERSION), ("b", protocol.CURRENT_VERSION), ("c", protocol.CURRENT_VERSION)]
    assert instances.serves("r1") == {"a", "b", "c"}
    assert {a: instances.holds("r1", a) for a in "abc"} == {"a": 0, "b": 0, "c": 0}


async def test_an_adapter_agents_requests_spread_over_every_instance_of_its_base_by_the_load_of_all_its_agents():
    server, instances, _, _, admission = cluster()
    assert await admission.admit("r0", "whole")
    for worker in ("r1", "r2"):
        assert await admission.admit(worker, "bases.shared")
    assert instances.instances("a") == instances.instances("c") == ["r1", "r2"]
    assert instances.instances("whole") == ["r0"]
    instances.add_work("r1", 100.0)  # agent b's requests in flight on r1
    streaming = StreamingServer(["r0", "r1", "r2"])
    client = RolloutClient(streaming, instances)
    tasks = [asyncio.ensure_future(client.generate(agent, protocol.GenGroup(GroupKey("e", agent, f"g{i}"), agent, 2, [1], 4, 1.0, 0)))
             for i, agent in enumerate("ac")]
    await until(lambda: streaming.sent)
    await asyncio.sleep(0)
    assert [(w, [g.agent for g in m.groups]) for w, m in streaming.sent] == [("r2", ["a", "c"])]
    streaming.answer(streaming.sent[0][1].request_id)
    await asyncio.gather(*tasks)


async def test_a_sync_of_an_adapter_agent_sends_only_its_adapter_to_every_instance_of_its_base():
    server, instances, versions, weights, admission = cluster()
    assert await admission.admit("r0", "whole")
    for worker in ("r1", "r2"):
        assert await admission.admit(worker, "bases.shared")
    server.calls.clear()
    await weights.sync("b", "t0", 1)
    assert [(w, kind, agent, v, lora) for w, kind, agent, v, lora in server.calls] == [
        ("t0", "PublishWeights", "b", 1, False), ("r1", "LoadWeights", "b", 1, True),
        ("r2", "LoadWeights", "b", 1, True)]
    assert versions["b"] == 1 and versions["a"] == 0
    assert (instances.holds("r1", "b"), instances.holds("r1", "a"), instances.holds("r0", "b")) == (1, 0, None)


async def test_each_group_carries_the_agents_synced_version():
    server = StreamingServer(["r0"])
    instances = RolloutInstances(UNITS)
    instances.serve("r0", "a", "placed by the test")
    versions = SyncedVersions(AGENTS)
    versions.set("a", 3)
    client = RolloutClient(server, instances, version_of=versions.__getitem__)
    task = asyncio.ensure_future(client.generate("a", protocol.GenGroup(GroupKey("e", "a", "g"), "a", 2, [1, 2], 4, 1.0, 0)))
    await until(lambda: len(server.sent) == 1)
    assert server.sent[0][1].groups[0].version == 3
    server.answer(server.sent[0][1].request_id)
    await task


async def test_a_rejoining_worker_serves_every_agent_of_the_base_with_the_fewest_instances():
    server, instances, _, _, admission = cluster()
    assert await admission.admit("r0", "whole")
    assert await admission.admit("r2", "whole")
    rejoin = Rejoin(UNITS, instances, admission, server, accepting=lambda: True, finished=lambda: False,
                    trainer_joined=lambda w: None)
    assert await rejoin.serve("r1") == "bases.shared"
    assert instances.serves("r1") == {"a", "b", "c"}


async def test_the_balancer_sees_engine_units_and_moves_an_instance_out_of_a_base_for_all_its_agents():
    server, instances, versions, weights, admission = cluster()
    assert await admission.admit("r0", "whole")
    for worker in ("r1", "r2"):
        assert await admission.admit(worker, "bases.shared")
    client = types.SimpleNamespace(dispatched_tokens={"whole": 10.0, "a": 5.0, "b": 6.0, "c": 7.0})
    balancer = Rebalancer(RouterConfig(), UNITS, instances, admission, client, server, weights,
                          {"whole": "/models/whole", "bases.shared": "/models/base"}, lambda e: None,
                          lambda: False)
    snapshot = balancer.demand_snapshot()
    assert set(snapshot) == {"whole", "bases.shared"}  # nothing to move between a, b and c
    assert snapshot["bases.shared"].dispatched_tokens == 18.0
    assert set(snapshot["bases.shared"].outstanding) == {"r1", "r2"}
    server.calls.clear()
    moved = await balancer.reassign("r2", "bases.shared", "whole", drain_timeout_s=1.0)
    assert moved is not None and moved.restarted  # out of a base: a whole model's engine
    assert instances.serves("r2") == {"whole"}
    assert [instances.instances(a) for a in "abc"] == [["r1"]] * 3
    assert server.calls[0][:3] == ("r2", "LoadModel", "whole")
