"""Level 1 balancing rules on plain demand snapshots: when instances move between agents,
how many, and never an oscillation, a move within the cooldown or an agent left without one;
the placement by a first batch's measured tokens."""

import itertools

import pytest

from flexmarl.controller.rollout.balance_rules import (BUSY_ENOUGH, AgentDemand, Move, RolloutBalancer,
                                                       instances_to_move, measured_placement, nearest_rule,
                                                       uneven_placement)
from flexmarl.controller.state.decisions import place_agents


def demand(**per_agent: list[float]) -> dict[str, AgentDemand]:
    """agent=[outstanding tokens of each instance]; instance names are agent + index."""
    return {a: AgentDemand({f"{a}{i}": tokens for i, tokens in enumerate(load)}) for a, load in per_agent.items()}


def at(snapshot: dict[str, AgentDemand], t: float) -> dict[str, AgentDemand]:
    """The snapshot at time t of agents that each finish 1 token per busy instance-second
    (so loads in seconds equal loads in tokens) and receive 1 token/s."""
    return {a: AgentDemand(d.outstanding, t, {w: t / len(d.outstanding) for w in d.outstanding})
            for a, d in snapshot.items()}


def observe_many(balancer: RolloutBalancer, snapshots, step: float = 0.5) -> list:
    """Observations every `step` seconds; the first only starts the measurements."""
    return [balancer.observe(at(s, i * step), i * step) for i, s in enumerate(snapshots)]


def test_skewed_demand_moves_an_instance_from_the_idlest_agent_to_the_busiest():
    balancer = RolloutBalancer(threshold=5.0, patience=3, cooldown_s=5.0)
    skewed = demand(solver=[1000, 1000], planner=[0, 0], checker=[10, 10])
    moves = observe_many(balancer, [skewed] * 4)
    assert moves[:3] == [None, None, None]  # patience: the third measured observation in a row decides
    assert moves[3] == Move(("planner0",), "planner", "solver", moves[3].why)
    assert "disparity" in moves[3].why


def test_equal_demand_moves_nothing():
    balancer = RolloutBalancer(threshold=5.0, patience=1, cooldown_s=0.0)
    equal = demand(solver=[500, 500], planner=[500, 500], checker=[500, 500])
    assert observe_many(balancer, [equal] * 20) == [None] * 20


def test_nothing_moves_before_the_receivers_service_rate_is_measured():
    balancer = RolloutBalancer(threshold=5.0, patience=1, cooldown_s=0.0)
    skewed = demand(solver=[1000, 1000], planner=[0, 0])
    assert [balancer.observe(skewed, t) for t in range(5)] == [None] * 5  # never seen busy


def test_a_receiver_with_less_work_than_a_move_costs_gets_nothing():
    balancer = RolloutBalancer(threshold=5.0, patience=1, cooldown_s=0.0, move_cost_s=600.0)
    assert observe_many(balancer, [demand(solver=[500, 500], planner=[0, 0])] * 5) == [None] * 5
    balancer = RolloutBalancer(threshold=5.0, patience=1, cooldown_s=0.0, move_cost_s=400.0)
    assert observe_many(balancer, [demand(solver=[500, 500], planner=[0, 0])] * 5)[1] is not None


def test_idle_system_moves_nothing():
    balancer = RolloutBalancer(patience=1, cooldown_s=0.0)
    idle = demand(solver=[0, 0], planner=[0, 0])
    assert observe_many(balancer, [idle] * 5) == [None] * 5


def test_oscillating_demand_never_flip_flops():
    balancer = RolloutBalancer(threshold=2.0, patience=3, cooldown_s=5.0)
    a_heavy = demand(a=[900, 900], b=[10, 10])
    b_heavy = demand(a=[10, 10], b=[900, 900])
    assert observe_many(balancer, [a_heavy, b_heavy] * 20) == [None] * 40


def test_no_second_move_within_the_cooldown_even_if_the_skew_persists():
    balancer = RolloutBalancer(threshold=2.0, patience=1, cooldown_s=5.0)
    skewed = demand(a=[900, 900, 900], b=[0, 0, 0, 0, 0, 0])
    moves = observe_many(balancer, [skewed] * 30, step=0.5)  # 15 s
    times = [i * 0.5 for i, m in enumerate(moves) if m is not None]
    assert times and all(t2 - t1 >= 5.0 for t1, t2 in itertools.pairwise(times))


def test_an_agent_is_never_left_without_an_instance():
    balancer = RolloutBalancer(threshold=2.0, patience=1, cooldown_s=0.0)
    # Every other agent has a single instance: there is no donor, however skewed the load.
    assert observe_many(balancer, [demand(a=[10_000], b=[0], c=[0])] * 5) == [None] * 5
    assert instances_to_move(work_dst=1e9, n_dst=1, work_src=0.0, n_src=5) == 4
    assert instances_to_move(work_dst=1e9, n_dst=1, work_src=0.0, n_src=1) == 0


def test_a_move_happens_only_if_it_lowers_the_larger_per_instance_load():
    # dst 10/instance, src 6/instance: taking one of src's two would leave src at 12 > 10.
    assert instances_to_move(work_dst=10, n_dst=1, work_src=12, n_src=2) == 0
    balancer = RolloutBalancer(threshold=1.0, patience=1, cooldown_s=0.0)
    assert observe_many(balancer, [demand(a=[10], b=[6, 6])] * 3) == [None] * 3


def test_at_scale_several_instances_move_at_once_to_even_out_the_load():
    balancer = RolloutBalancer(threshold=5.0, patience=1, cooldown_s=0.0)
    move = observe_many(balancer, [demand(a=[1000] * 10, b=[0] * 10)] * 2)[1]
    assert move is not None and len(move.instances) == 9 and move.src == "b" and move.dst == "a"


def test_token_demand_is_weighed_by_each_agents_measured_service_rate():
    # Equal tokens outstanding, but agent `slow` finishes ten times fewer tokens per busy
    # second: its work takes ten times longer, so it is the one that needs instances.
    balancer = RolloutBalancer(threshold=5.0, patience=2, cooldown_s=0.0, smoothing_s=1.0)
    def snap(t: int) -> dict[str, AgentDemand]:
        return {"fast": AgentDemand({"f0": 1000, "f1": 1000}, 1000.0 * t, {"f0": 0.1 * t, "f1": 0.1 * t}),
                "slow": AgentDemand({"s0": 1000, "s1": 1000}, 1000.0 * t, {"s0": 1.0 * t, "s1": 1.0 * t})}
    moves = [balancer.observe(snap(t), float(t)) for t in range(4)]
    move = next(m for m in moves if m is not None)
    assert (move.src, move.dst) == ("fast", "slow")
    assert balancer.loads["slow"] == pytest.approx(10 * balancer.loads["fast"])


def test_an_agent_that_lost_every_instance_gets_one_back():
    balancer = RolloutBalancer(threshold=5.0, patience=1, cooldown_s=0.0)
    move = balancer.observe({"a": AgentDemand({}, 0.0), "b": AgentDemand({"b0": 5, "b1": 0, "b2": 7})}, 0.0)
    # a has nothing outstanding but also no instance: no demand, no move.
    assert move is None
    balancer = RolloutBalancer(threshold=5.0, patience=1, cooldown_s=0.0)
    balancer.observe({"a": AgentDemand({}, 0.0), "b": AgentDemand({"b0": 5, "b1": 0, "b2": 7})}, 0.0)
    move = balancer.observe({"a": AgentDemand({}, 800.0), "b": AgentDemand({"b0": 5, "b1": 0, "b2": 7})}, 1.0)
    assert move is not None and move.dst == "a" and move.instances[0] == "b1"  # the least outstanding


def sent(**per_agent: tuple[float, int]) -> dict[str, AgentDemand]:
    """agent=(tokens dispatched so far, instances)."""
    return {a: AgentDemand({f"{a}{i}": 0.0 for i in range(n)}, tokens) for a, (tokens, n) in per_agent.items()}


def test_uneven_placement_names_the_most_and_least_asked_instances_past_the_threshold():
    # agent00: 2 instances sent 1,536 tokens (768 each); agent31: 62 sent 1,536 (24.8 each)
    found = uneven_placement(sent(agent00=(1536, 2), agent15=(1536, 32), agent31=(1536, 62)), 5.0)
    assert found is not None and found[:2] == ("agent00", "agent31") and found[2] == pytest.approx(31.0)
    assert uneven_placement(sent(a=(400, 4), b=(90, 1)), 5.0) is None  # 100 vs 90 per instance
    assert uneven_placement(sent(a=(500, 1), b=(200, 2)), 5.0)[2] == 5.0  # the threshold itself counts


def test_uneven_placement_says_nothing_where_no_instance_could_move():
    # one instance per agent (three agents, three workers): no other placement exists
    assert uneven_placement(sent(planner=(120, 1), solver=(900, 1), checker=(1500, 1)), 5.0) is None
    # the fewest-asked could give one up: named, past one that could not
    assert uneven_placement(sent(a=(1000, 1), b=(10, 1), c=(40, 2)), 5.0)[:2] == ("a", "c")


def test_the_nearest_placement_rule_is_the_one_whose_shares_the_tokens_sent_fit():
    rules = {"chain": {"a": 1.0, "b": 2.0, "c": 3.0}, "parallel": {"a": 1.0, "b": 1.0, "c": 1.0}}
    name, off = nearest_rule({"a": 100, "b": 110, "c": 95}, rules)
    assert name == "parallel" and off == pytest.approx(110 / 305 * 3)
    assert nearest_rule({"a": 100, "b": 210, "c": 290}, rules)[0] == "chain"
    assert nearest_rule({"a": 0, "b": 0, "c": 0}, rules) == ("", float("inf"))  # nothing sent


def test_uneven_placement_leaves_out_units_sent_nothing_yet():
    assert uneven_placement(sent(a=(1000, 1), b=(0, 10)), 5.0) is None  # b may be asked later
    assert uneven_placement(sent(a=(1000, 1)), 5.0) is None  # one unit: nothing to compare


def placed_after(snapshot: dict[str, AgentDemand], moves) -> dict[str, int]:
    count = {a: len(d.outstanding) for a, d in snapshot.items()}
    for m in moves:
        assert len(set(m.instances)) == len(m.instances) and set(m.instances) <= set(snapshot[m.src].outstanding)
        count[m.src] -= len(m.instances)
        count[m.dst] += len(m.instances)
    return count


def test_the_measured_placement_shares_the_instances_out_by_the_tokens_each_unit_was_sent():
    # the wide point at 1,024 x 32 as the chain rule places it: 2 .. 62 instances, every agent sent alike
    have = [len(p) for p in place_agents([f"agent{i:02d}" for i in range(32)], [f"w{i}" for i in range(1024)],
                                         {f"agent{i:02d}": 16.0 * (i + 1) for i in range(32)}).values()]
    assert (have[0], have[-1]) == (2, 62)
    wide = sent(**{f"agent{i:02d}": (1536.0, n) for i, n in enumerate(have)})
    moves = measured_placement(wide, 5.0)
    assert set(placed_after(wide, moves).values()) == {32}
    assert sum(len(m.instances) for m in moves) == sum(n - 32 for n in have if n > 32)
    assert all(len(wide[m.src].outstanding) > 32 > len(wide[m.dst].outstanding) for m in moves)
    assert "agent00 was sent 31.0x the tokens of each of agent31's" in moves[0].why
    # shares that are not equal: 1 : 3 : 4 of 16 instances, from 8 / 4 / 4
    uneven = sent(a=(100, 8), b=(300, 4), c=(400, 4))
    assert placed_after(uneven, measured_placement(uneven, 5.0)) == {"a": 2, "b": 6, "c": 8}


def test_the_measured_placement_moves_nothing_where_the_shares_are_even_enough_or_nothing_could_move():
    assert measured_placement(sent(a=(400, 4), b=(90, 1)), 5.0) == []  # 100 vs 90 per instance
    assert measured_placement(sent(planner=(120, 1), solver=(900, 1), checker=(1500, 1)), 5.0) == []
    assert measured_placement(sent(a=(1000, 2)), 5.0) == []


def test_the_measured_placement_leaves_units_sent_nothing_as_they_are_and_gives_the_least_loaded_first():
    snapshot = sent(a=(1000, 1), b=(100, 5), idle=(0, 6))
    snapshot["b"].outstanding.update(b0=40.0, b1=0.0, b2=10.0, b3=0.0, b4=5.0)
    moves = measured_placement(snapshot, 5.0)
    assert placed_after(snapshot, moves) == {"a": 5, "b": 1, "idle": 6}  # idle may be asked later
    assert [m.instances for m in moves] == [("b1", "b3", "b4", "b2")]  # b0, the busiest, stays


def test_the_measured_placement_keeps_the_first_where_the_most_asked_instances_were_not_busy():
    uneven = sent(a=(100, 8), b=(300, 4), c=(400, 4))  # c's instances: 8x the tokens of a's each
    assert measured_placement(uneven, 5.0, {"a": 0.1, "b": 0.3, "c": BUSY_ENOUGH - 0.01}) == []
    assert placed_after(uneven, measured_placement(uneven, 5.0, {"a": 0.1, "b": 0.3, "c": BUSY_ENOUGH})) == \
        {"a": 2, "b": 6, "c": 8}
    assert measured_placement(uneven, 5.0, None) == measured_placement(uneven, 5.0, {"c": 0.9})  # unknown: busy
