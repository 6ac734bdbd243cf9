from flexmarl.controller.allocator import choose_placement

TRAINERS = ["t0", "t1"]


def test_free_slot_goes_to_the_least_loaded_trainer():
    assert choose_placement("c", TRAINERS, 2, {"a": "t0"}, {}, {}, {}) == ("t1", None)


def test_unlimited_capacity_never_parks_anyone():
    resident = {"a": "t0", "b": "t1", "c": "t0"}
    assert choose_placement("d", TRAINERS, 0, resident, {}, {}, {}) == ("t1", None)


def test_full_pool_parks_the_idle_agent_with_least_ready_work():
    resident = {"a": "t0", "b": "t1"}
    assert choose_placement("c", TRAINERS, 1, resident, {}, {"a": 5, "b": 1}, {}) == ("t1", "b")


def test_an_agent_with_work_in_flight_is_never_parked():
    resident = {"a": "t0", "b": "t1"}
    assert choose_placement("c", TRAINERS, 1, resident, {"b": 1}, {"a": 5, "b": 0}, {}) == ("t0", "a")
    assert choose_placement("c", TRAINERS, 1, resident, {"a": 1, "b": 2}, {}, {}) is None


def test_ties_go_to_the_longest_unused_agent():
    resident = {"a": "t0", "b": "t1"}
    assert choose_placement("c", TRAINERS, 1, resident, {}, {}, {"a": 10.0, "b": 5.0}) == ("t1", "b")
