"""The rollout instances' owner on its own: which agents each instance serves (a set), the
version of each it holds, its outstanding work and what it served before, with the
AllocationChanged event of every change."""

import types

from flexmarl.controller.instances import RolloutInstances
from flexmarl.runtime import events as ev


def owner(alive):
    server = types.SimpleNamespace(registry=types.SimpleNamespace(
        alive=lambda role=None: [types.SimpleNamespace(worker_id=w) for w in sorted(alive)]))
    events = []
    return RolloutInstances(server, events.append), events


def test_one_instance_may_serve_several_agents_and_holds_a_version_of_each():
    instances, _ = owner({"r0", "r1"})
    instances.engine_started("r0", "a", 0)
    instances.serve("r0", "a", "r0 joins")
    instances.loaded("r0", "b", 3)
    instances.serve("r0", "b", "r0 joins")
    instances.serve("r1", "b", "r1 joins")
    assert instances.instances("a") == ["r0"] and instances.instances("b") == ["r0", "r1"]
    assert instances.serves("r0") == {"a", "b"}
    assert (instances.holds("r0", "a"), instances.holds("r0", "b"), instances.holds("r1", "b")) == (0, 3, None)
    instances.engine_started("r0", "c", 0)  # a restart on another model holds nothing else
    assert (instances.holds("r0", "a"), instances.holds("r0", "c")) == (None, 0)


def test_a_dead_instance_leaves_every_agent_holds_nothing_and_remembers_what_it_served():
    alive = {"r0", "r1"}
    instances, events = owner(alive)
    for worker, agent in (("r0", "a"), ("r1", "b"), ("r1", "a")):
        instances.loaded(worker, agent, 2)
        instances.serve(worker, agent, f"{worker} joins")
    alive.discard("r1")
    assert instances.instances("a") == ["r0"]  # a dead worker is never routed to, even before it is removed
    instances.died("r1")
    assert instances.assignment == {"a": ["r0"], "b": []} and instances.serves("r1") == set()
    assert instances.holds("r1", "a") is None and instances.served_before("r1") == "a"
    alive.add("r1")
    instances.serve("r1", "b", "r1 rejoined")
    assert instances.instances("b") == ["r1"] and instances.served_before("r1") == "a"
    assert [(e.agent, e.workers, e.why) for e in events if isinstance(e, ev.AllocationChanged)][-3:] == [
        ("a", ["r0"], "r1 died"), ("b", [], "r1 died"), ("b", ["r1"], "r1 rejoined")]


def test_routing_follows_set_ups_placement_whatever_order_the_engines_finish_in_then_joins():
    instances, _ = owner({"r0", "r1", "r2", "r3"})
    instances.place({"a": ["r0", "r2"], "b": ["r1"]})
    for worker, agent in (("r2", "a"), ("r1", "b"), ("r0", "a")):  # engines finished in this order
        instances.serve(worker, agent, "joins")
    instances.serve("r3", "a", "joins")  # a later join goes last
    assert instances.instances("a") == ["r0", "r2", "r3"]
    instances.leave("r2", "a", "r2 leaves for b")
    assert instances.instances("a") == ["r0", "r3"] and instances.served_before("r2") == "a"


def test_outstanding_work_is_counted_per_instance_by_what_is_added_and_done():
    instances, _ = owner({"r0"})
    instances.add_work("r0", 40.0)
    instances.add_work("r0", 2.0)
    instances.work_done("r0", 40.0)
    assert instances.outstanding["r0"] == 2.0 and instances.outstanding["r1"] == 0.0
