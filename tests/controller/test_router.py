from flexmarl.controller.router import route_batch
from flexmarl.controller.decisions import place_agents


def test_small_batch_goes_whole_to_the_least_loaded_instance():
    assert route_batch([5, 5], {"r0": 100.0, "r1": 10.0}) == {"r1": [0, 1]}


def test_large_batch_is_split_to_balance_outstanding_work():
    plan = route_batch([10] * 16, {"r0": 0.0, "r1": 40.0})
    assert sorted(i for ix in plan.values() for i in ix) == list(range(16))
    load = {w: (40.0 if w == "r1" else 0.0) + 10 * len(ix) for w, ix in plan.items()}
    assert abs(load["r0"] - load["r1"]) <= 10


def test_initial_placement_gives_every_agent_an_instance_and_spares_to_the_busiest():
    plan = place_agents(["a", "b", "c"], ["r0", "r1", "r2", "r3"], {"a": 1.0, "b": 10.0, "c": 2.0})
    assert plan == {"a": ["r0"], "b": ["r1", "r3"], "c": ["r2"]}


def test_a_dead_instance_leaves_its_agent_and_is_taken_back_once_it_rejoins():
    import types

    from flexmarl.controller.router import RolloutClient
    from flexmarl.runtime import events as ev

    alive = {"r0", "r1"}
    server = types.SimpleNamespace(registry=types.SimpleNamespace(
        alive=lambda role=None: [types.SimpleNamespace(worker_id=w) for w in sorted(alive)]))
    events = []
    client = RolloutClient(server, emit=events.append)
    client.assignment = {"a": ["r0"], "b": ["r1"]}
    alive.discard("r1")
    client.worker_died("r1")
    assert client.assignment["b"] == [] and client.served_before == {"r1": "b"}
    alive.add("r1")
    client.rejoined("r1", "b")
    assert client.instances("b") == ["r1"] and client.served_before == {}
    assert [(e.agent, e.workers, e.why) for e in events if isinstance(e, ev.AllocationChanged)] == [
        ("b", [], "r1 died"), ("b", ["r1"], "r1 rejoined")]
