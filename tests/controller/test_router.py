"""Level 2 routing: the decision functions over plain numbers, and the rollout client
that batches an agent's requests, sends them where `plan_routes` says and re-issues what
a dead instance left unfinished."""

import asyncio

import pytest

from flexmarl.controller.instances import RolloutInstances
from flexmarl.controller.router import RolloutClient, plan_routes, route_batch
from flexmarl.runtime import protocol

from fake_rollout import FakeServer, until


def client_over(server, assignment):
    """A rollout client whose instances serve `assignment` (agent -> workers, in order)."""
    instances = RolloutInstances(server)
    for agent, workers in assignment.items():
        for w in workers:
            instances.serve(w, agent, "placed by the test")
    return RolloutClient(server, instances)


def test_small_batch_goes_whole_to_the_least_loaded_instance():
    assert route_batch([5, 5], {"r0": 100.0, "r1": 10.0}) == {"r1": [0, 1]}


def test_large_batch_is_split_to_balance_outstanding_work():
    plan = route_batch([10] * 16, {"r0": 0.0, "r1": 40.0})
    assert sorted(i for ix in plan.values() for i in ix) == list(range(16))
    load = {w: (40.0 if w == "r1" else 0.0) + 10 * len(ix) for w, ix in plan.items()}
    assert abs(load["r0"] - load["r1"]) <= 10


def test_plan_routes_takes_the_policy_from_the_table_and_round_robin_turns_with_each_batch():
    outstanding = {"r0": 0.0, "r1": 100.0}
    assert plan_routes("least_loaded", [5, 5], outstanding, 0) == {"r0": [0, 1]}
    assert [plan_routes("round_robin", [5], outstanding, turn) for turn in range(3)] == [
        {"r0": [0]}, {"r1": [0]}, {"r0": [0]}]
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        plan_routes("fastest", [5], outstanding, 0)
    with pytest.raises(ValueError, match="no instance"):
        plan_routes("least_loaded", [5], {}, 0)


async def test_requests_on_a_dead_instance_are_reissued_to_a_live_instance_of_the_agent():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r0", "r1"]})
    requests = [protocol.GenRequest(f"s{i}", [1, 2], 4, 1.0, i) for i in range(3)]
    task = asyncio.ensure_future(client.generate("a", requests))
    await until(lambda: len(server.sent) == 1)
    assert server.sent[0][0] == "r0"  # a small batch goes whole to one instance
    server.kill("r0")
    await until(lambda: len(server.sent) == 2)
    worker, msg = server.sent[1]
    assert worker == "r1" and sorted(it.sample_id for it in msg.items) == ["s0", "s1", "s2"]
    server.answer(msg.request_id)
    results = await task
    assert [r.sample_id for r in results] == ["s0", "s1", "s2"]
    assert client.reissued == 3 and client.outstanding["r0"] == 0 and client.outstanding["r1"] == 0


async def test_a_batch_whose_instances_keep_dying_fails_its_requests_instead_of_being_reissued_forever():
    from flexmarl.controller.router import RequestsFailed

    workers = [f"r{i}" for i in range(5)]
    server = FakeServer(workers)
    client = client_over(server, {"a": list(workers)})
    task = asyncio.ensure_future(client.generate("a", [protocol.GenRequest("s0", [1], 2, 1.0, 0)]))
    for attempt in range(client.max_attempts):
        await until(lambda: len(server.sent) == attempt + 1)
        server.kill(server.sent[-1][0])  # e.g. a request that crashes every engine it reaches
    with pytest.raises(RequestsFailed, match=f"failed on {client.max_attempts} instances in a row"):
        await task
    assert len(server.sent) == client.max_attempts  # never sent to a fourth instance
    assert sum(w.alive for w in server.registry.workers.values()) == 5 - client.max_attempts


async def test_a_refused_request_fails_alone_and_is_never_reissued():
    from flexmarl.controller.router import RequestRefused

    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r0", "r1"]})
    good = asyncio.ensure_future(client.generate("a", [protocol.GenRequest("ok", [1], 2, 1.0, 0)]))
    bad = asyncio.ensure_future(client.generate("a", [protocol.GenRequest("long", [1] * 99, 2, 1.0, 0)]))
    await until(lambda: len(server.sent) == 1)  # both coalesced into one batch
    server.answer(server.sent[0][1].request_id, refuse=frozenset({"long"}))
    assert [r.sample_id for r in await good] == ["ok"]
    with pytest.raises(RequestRefused, match="refused long: prompt too long"):
        await bad
    await asyncio.sleep(0.01)
    assert len(server.sent) == 1 and client.refused == 1 and client.reissued == 0
    assert client.outstanding["r0"] == 0 and client.outstanding["r1"] == 0


async def test_an_instance_removed_from_the_assignment_gets_no_new_requests():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r1"]})  # r0 is draining for a move
    requests = [protocol.GenRequest(f"s{i}", [1], 2, 1.0, i) for i in range(16)]
    task = asyncio.ensure_future(client.generate("a", requests))
    await until(lambda: len(server.sent) >= 1)
    assert {w for w, _ in server.sent} == {"r1"}
    for _, msg in list(server.sent):
        server.answer(msg.request_id)
    assert len(await task) == 16


async def test_requests_wait_for_an_instance_while_one_is_restarting_and_then_the_run_stops_saying_why():
    from flexmarl.controller.failures import RunFailed
    from flexmarl.controller.router import NoInstance

    server = FakeServer(["r0"])
    client = client_over(server, {"a": ["r0"]})
    client.instance_wait_s = 0.3
    restarting = [True]
    client.instance_expected = lambda: restarting[0]
    server.kill("r0")
    server.registry.workers["r0"].why_gone = "no heartbeat for 10.7s (timeout 10.0s)"
    client.owner.died("r0")
    task = asyncio.ensure_future(client.generate("a", [protocol.GenRequest("s0", [1], 2, 1.0, 0)]))
    await asyncio.sleep(0.6)  # past instance_wait_s: still waiting, a restart is under way
    assert not task.done()
    restarting[0] = False  # the restart gave up (or none is coming): the wait runs out
    with pytest.raises(NoInstance) as info:
        await task
    assert isinstance(info.value, RunFailed)  # the run's failure, not the episode's
    assert str(info.value) == ("the run stopped: no rollout instance served agent 'a' for 0.3s and none is being "
                               "restarted; gone: r0 (no heartbeat for 10.7s (timeout 10.0s)). See the workers' "
                               "logs in the run directory's logs/ folder")
