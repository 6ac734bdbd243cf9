"""NCCL groups: an agent's communicator is kept while its trainer and instances stay,
replaced (a new name) when either changes, dropped after a failed sync."""

from flexmarl.controller.weights.nccl_groups import NcclGroups


def test_a_group_is_kept_while_its_members_stay_and_ranks_count_from_one_after_the_trainer():
    groups = NcclGroups()
    g = groups.for_sync("planner", "t0", ["r2", "r0"])
    assert (g.trainer, g.instances, g.rank("r2"), g.rank("r0")) == ("t0", ("r2", "r0"), 1, 2)
    assert groups.for_sync("planner", "t0", ["r0", "r2"]) is g
    assert groups.for_sync("solver", "t0", ["r1"]).name != g.name


def test_another_trainer_or_instance_set_makes_a_new_group_with_a_new_name():
    groups = NcclGroups()
    names = {groups.for_sync("planner", "t0", ["r0"]).name, groups.for_sync("planner", "t1", ["r0"]).name,
             groups.for_sync("planner", "t1", ["r0", "r1"]).name, groups.for_sync("planner", "t1", ["r1"]).name}
    assert len(names) == 4


def test_a_dropped_group_is_never_named_again():
    groups = NcclGroups()
    first = groups.for_sync("planner", "t0", ["r0"])
    groups.drop("planner")
    assert groups.current("planner") is None
    assert groups.for_sync("planner", "t0", ["r0"]).name != first.name


def test_two_controllers_never_name_a_group_alike():
    assert NcclGroups().for_sync("planner", "t0", ["r0"]).name != NcclGroups().for_sync("planner", "t0", ["r0"]).name


def test_instances_whose_engines_span_several_ranks_take_consecutive_ranks():
    groups = NcclGroups()
    g = groups.for_sync("planner", "t0", ["r0", "r1", "r2"], width=4)
    assert [g.rank(w) for w in ("r0", "r1", "r2")] == [1, 5, 9] and g.receivers == 12
    assert groups.for_sync("planner", "t0", ["r0", "r1", "r2"], width=4) is g
    assert groups.for_sync("planner", "t0", ["r0", "r1", "r2"], width=2).name != g.name  # other ranks
