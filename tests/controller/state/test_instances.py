"""The rollout instances' owner on its own: which agents each instance serves (a set), the
version of each it holds (a whole model's load replacing it, an adapter's adding to it), its
outstanding work and what it served before, with the AllocationChanged event of every change."""

from flexmarl.controller.state.instances import RolloutInstances
from flexmarl.runtime import events as ev
from flexmarl.runtime.bases import EngineUnit, whole_models

UNITS = {**whole_models(["a", "b", "c"]), "bases.x": EngineUnit("bases.x", ("x", "y"), lora=True)}


def owner():
    events = []
    return RolloutInstances(UNITS, events.append), events


def test_loading_a_whole_model_replaces_what_an_instance_holds_and_an_adapter_adds_to_it():
    instances, _ = owner()
    instances.engine_started("r0", "a", 0)
    instances.loaded("r0", "b", 3)  # b's weights swapped in place: a's are gone
    assert (instances.holds("r0", "a"), instances.holds("r0", "b")) == (None, 3)
    instances.loaded("r0", "a", 2)
    assert (instances.holds("r0", "a"), instances.holds("r0", "b")) == (2, None)
    instances.engine_started("r1", "bases.x", 0)  # a base's engine: no adapter yet
    instances.loaded("r1", "x", 1)
    instances.loaded("r1", "y", 4)
    assert (instances.holds("r1", "x"), instances.holds("r1", "y")) == (1, 4)
    instances.engine_started("r0", "c", 0)  # a restart on another model holds nothing else
    assert (instances.holds("r0", "a"), instances.holds("r0", "c"), instances.starts("r0")) == (None, 0, 2)


def test_one_instance_may_serve_several_agents():
    instances, _ = owner()
    for worker, agent in (("r0", "x"), ("r0", "y"), ("r1", "y")):
        instances.serve(worker, agent, f"{worker} joins")
    assert instances.instances("x") == ["r0"] and instances.instances("y") == ["r0", "r1"]
    assert instances.serves("r0") == {"x", "y"} and instances.serving("r1", "y") and not instances.serving("r1", "x")


def test_a_dead_instance_leaves_every_agent_holds_nothing_and_remembers_what_it_served():
    instances, events = owner()
    for worker, agent in (("r0", "a"), ("r1", "x"), ("r1", "y")):
        instances.loaded(worker, agent, 2)
        instances.serve(worker, agent, f"{worker} joins")
    instances.died("r1")
    assert instances.assignment == {"a": ["r0"], "x": [], "y": []} and instances.serves("r1") == set()
    assert instances.holds("r1", "x") is None and instances.served_before("r1") == "bases.x"
    instances.serve("r1", "b", "r1 rejoined")
    assert instances.instances("b") == ["r1"] and instances.served_before("r1") == "bases.x"
    assert [(e.agent, e.workers, e.why) for e in events if isinstance(e, ev.AllocationChanged)][-3:] == [
        ("x", [], "r1 died"), ("y", [], "r1 died"), ("b", ["r1"], "r1 rejoined")]


def test_routing_follows_set_ups_placement_whatever_order_the_engines_finish_in_then_joins():
    instances, _ = owner()
    instances.place({"a": ["r0", "r2"], "b": ["r1"]})
    for worker, agent in (("r2", "a"), ("r1", "b"), ("r0", "a")):  # engines finished in this order
        instances.serve(worker, agent, "joins")
    instances.serve("r3", "a", "joins")  # a later join goes last
    assert instances.instances("a") == ["r0", "r2", "r3"]
    instances.leave("r2", "a", "r2 leaves for b")
    assert instances.instances("a") == ["r0", "r3"] and instances.served_before("r2") == "a"


def test_outstanding_work_is_counted_per_instance_by_what_is_added_and_done():
    instances, _ = owner()
    instances.add_work("r0", 40.0)
    instances.add_work("r0", 2.0)
    instances.work_done("r0", 40.0)
    assert instances.outstanding["r0"] == 2.0 and instances.outstanding["r1"] == 0.0


def test_an_instance_whose_last_group_came_back_counts_as_drained_and_tells_who_asked():
    instances, _ = owner()
    told = []
    instances.on_drained.append(told.append)
    for worker in ("r0", "r1"):
        instances.serve(worker, "a", f"{worker} joins")
    instances.add_work("r0", 40.0)
    instances.add_work("r0", 2.0)
    assert instances.drained("a") == 1 and instances.drained("b") == 0  # r1 has nothing; b no instance
    instances.work_done("r0", 40.0)
    assert told == [] and instances.drained("a") == 1  # one group still out on r0
    instances.work_done("r0", 2.0)
    assert told == ["r0"] and instances.drained("a") == 2
