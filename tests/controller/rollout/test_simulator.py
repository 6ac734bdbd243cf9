import pytest

from flexmarl.controller.rollout.simulator import CONFIGS, Simulation, simulate, skewed_workload

INSTANCES = 24


@pytest.fixture(scope="module")
def results():
    workload = skewed_workload(queries=300, concurrency=64, seed=0)
    return {c: simulate(workload, INSTANCES, c) for c in CONFIGS}


def test_hierarchical_balancing_beats_the_static_split_on_the_skewed_workload(results):
    assert results["hierarchical"].samples_per_s >= 1.2 * results["static"].samples_per_s
    assert results["hierarchical"].reassignments > 0
    assert results["static"].reassignments == results["intra"].reassignments == 0


def test_least_loaded_routing_is_no_slower_than_round_robin(results):
    assert results["intra"].samples_per_s >= results["static"].samples_per_s


def test_every_sample_of_every_query_is_generated_in_every_config(results):
    per_query = 4 + 4 * 8 + 4 * 8 * 1  # planner, solver, checker groups of the chain
    assert {r.samples for r in results.values()} == {300 * per_query}


def test_level_one_leaves_every_agent_at_least_one_instance(results):
    final = results["hierarchical"].final_assignment
    assert min(final.values()) >= 1
    assert final["solver"] > INSTANCES // 3  # the heavy agent got more than its equal share


def test_the_simulation_is_deterministic_for_a_seed():
    a = simulate(skewed_workload(queries=100, concurrency=32, seed=3), 12, "hierarchical")
    b = simulate(skewed_workload(queries=100, concurrency=32, seed=3), 12, "hierarchical")
    assert (a.samples_per_s, a.busy, a.reassignments) == (b.samples_per_s, b.busy, b.reassignments)
    c = simulate(skewed_workload(queries=100, concurrency=32, seed=4), 12, "hierarchical")
    assert c.virtual_s != a.virtual_s  # the seed matters: output lengths differ


def test_busy_fractions_are_fractions_of_the_virtual_time(results):
    for r in results.values():
        assert len(r.busy) == INSTANCES and all(0.0 <= b <= 1.0 for b in r.busy)


def test_unknown_configs_and_too_few_instances_are_refused():
    with pytest.raises(ValueError, match="unknown config"):
        Simulation(skewed_workload(10, 4), 6, "fancy")
    with pytest.raises(ValueError, match="at least 3 instances"):
        Simulation(skewed_workload(10, 4), 2, "static")
