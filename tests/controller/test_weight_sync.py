"""The weight-sync component with a fake server: publish once, load on every instance,
transport chosen from where the ends are, an instance dying mid-sync leaves the agent."""

import asyncio
import types

import pytest

from flexmarl.controller.server import RemoteError, WorkerDied
from flexmarl.controller.weight_sync import WeightSync, transport_between
from flexmarl.runtime import protocol
from flexmarl.runtime.param_types import Location


class FakeServer:
    def __init__(self, hosts: dict[str, str], devices: dict[str, str] | None = None, dies=(), fails=()):
        devices = devices or {}
        self.registry = types.SimpleNamespace(workers={
            w: types.SimpleNamespace(host=h, pid=i + 1, devices=[devices[w]] if w in devices else [])
            for i, (w, h) in enumerate(hosts.items())})
        self.calls, self.dies, self.fails, self._id = [], set(dies), set(fails), 0

    def next_request_id(self):
        self._id += 1
        return self._id

    async def call(self, worker, msg, buffers=(), timeout=None):
        self.calls.append((worker, msg))
        if worker in self.dies:
            raise WorkerDied(worker, "killed")
        if worker in self.fails:
            raise RemoteError(f"{worker} refused")
        if isinstance(msg, protocol.PublishWeights):
            return protocol.WeightsPublished(msg.request_id, msg.agent, msg.version, FAKE_HANDLE, 1024, 0.0), []
        return protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version, 0.0), []


# The controller never looks inside a handle: any value stands in for one here.
FAKE_HANDLE = object()


def test_the_transport_follows_where_the_ends_are():
    t, same, other = Location("h1", 1), Location("h1", 2), Location("h2", 3)
    assert transport_between(t, [same]) == "shm"
    assert transport_between(t, [other]) == "tcp"
    assert transport_between(t, [same, other]) == "tcp"  # one handle must reach both
    g, g2 = Location("h1", 1, "cuda:0"), Location("h2", 2, "cuda:0")
    assert transport_between(g, [Location("h1", 2, "cuda:0")]) == "cuda_ipc"  # the same GPU
    assert transport_between(g, [Location("h1", 2, "cuda:1")]) == "nccl"  # another GPU of the host
    assert transport_between(g, [g2, Location("h1", 2, "cuda:0")]) == "nccl"


async def test_a_sync_publishes_once_loads_every_instance_and_then_reports_the_version():
    server = FakeServer({"t0": "h", "r0": "h", "r1": "h"})
    synced = []
    ws = WeightSync(["a"], server, lambda agent: ["r0", "r1"], lambda e: None, lambda a, v: synced.append((a, v)))
    await ws.sync("a", "t0", 3)
    kinds = [(w, type(m).__name__) for w, m in server.calls]
    assert kinds == [("t0", "PublishWeights"), ("r0", "LoadWeights"), ("r1", "LoadWeights")]
    assert server.calls[0][1].transport == "shm"
    assert synced == [("a", 3)] and ws.synced["a"] == 3
    assert ws.holds == {"r0": ("a", 3), "r1": ("a", 3)}


async def test_an_instance_that_dies_during_a_sync_is_left_out_and_the_sync_completes():
    server = FakeServer({"t0": "h", "r0": "h", "r1": "h"}, dies={"r1"})
    ws = WeightSync(["a"], server, lambda agent: ["r0", "r1"], lambda e: None, lambda a, v: None)
    await ws.sync("a", "t0", 1)
    assert ws.holds == {"r0": ("a", 1)} and ws.synced["a"] == 1


async def test_an_instance_refusing_the_weights_fails_the_sync_and_reports_no_version():
    server = FakeServer({"t0": "h", "r0": "h"}, fails={"r0"})
    synced = []
    ws = WeightSync(["a"], server, lambda agent: ["r0"], lambda e: None, lambda a, v: synced.append(v))
    with pytest.raises(RemoteError):
        await ws.sync("a", "t0", 1)
    assert synced == [] and ws.synced["a"] == 0


async def test_a_sync_waits_for_the_agents_lock():
    server = FakeServer({"t0": "h", "r0": "h"})
    ws = WeightSync(["a"], server, lambda agent: ["r0"], lambda e: None, lambda a, v: None)
    await ws.locks["a"].acquire()
    task = asyncio.ensure_future(ws.sync("a", "t0", 1))
    await asyncio.sleep(0.01)
    assert server.calls == []
    ws.locks["a"].release()
    await asyncio.wait_for(task, 1)
    assert len(server.calls) == 2
