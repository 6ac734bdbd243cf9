"""The pipeline's rules on plain data: staleness bound, exactly-once, whole groups,
and async micro-batches identical to sync ones for the same arrival order."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flexmarl.controller import decisions
from flexmarl.controller.store import DROPPED, ExperienceStore

BATCH = 6  # trains version 5 into 6


@st.composite
def scenarios(draw):
    n_groups = draw(st.integers(1, 12))
    sizes = [draw(st.integers(1, 4)) for _ in range(n_groups)]
    versions = [[draw(st.integers(BATCH - 5, BATCH - 1)) for _ in range(s)] for s in sizes]
    order = draw(st.permutations(range(n_groups)))
    # after which arrivals the agent loop wakes up and forms micro-batches
    wakeups = draw(st.lists(st.booleans(), min_size=n_groups, max_size=n_groups))
    return sizes, versions, list(order), wakeups, draw(st.integers(0, 2)), draw(st.integers(1, 8))


def drive(sizes, versions, order, wakeups, k, micro_batch, overlap):
    store = ExperienceStore(["a"])
    groups = [store.open_group("a", f"g{i}", [1], size, BATCH) for i, size in enumerate(sizes)]
    formed = []
    for i, wake in zip(order, wakeups):
        for sample, v in zip(groups[i], versions[i]):
            store.record_output(sample.sample_id, [2], [-1.0], [v])
            store.set_reward(sample.sample_id, float(v % 2))
        if wake:
            formed += decisions.form_micro_batches(store, "a", BATCH, micro_batch, False, overlap, k)
    formed += decisions.form_micro_batches(store, "a", BATCH, micro_batch, True, overlap, k)
    return store, formed


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_no_sample_older_than_k_is_ever_trained_over_random_arrival_orders(scenario):
    sizes, versions, order, wakeups, k, micro_batch = scenario
    store, formed = drive(sizes, versions, order, wakeups, k, micro_batch, overlap=True)
    trained = [s for mb in formed for s in mb]
    assert all(decisions.lag(BATCH - 1, s.versions) <= k for s in trained)
    ids = [s.sample_id for s in trained]
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    # every group is either trained whole in one micro-batch, or dropped whole as stale
    where = {}
    for n, mb in enumerate(formed):
        for s in mb:
            where.setdefault(s.group_id, set()).add(n)
    assert all(len(batches) == 1 for batches in where.values()), "a group was split"
    for i, vs in enumerate(versions):
        stale = any(decisions.too_stale(BATCH - 1, [v], k) for v in vs)
        assert (f"g{i}" not in where) == stale
        assert (store.groups[f"g{i}"].status == DROPPED) == stale
    assert all(len(mb) <= micro_batch or len({s.group_id for s in mb}) == 1 for mb in formed)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_async_micro_batches_equal_sync_ones_for_the_same_arrival_order(scenario):
    sizes, versions, order, wakeups, k, micro_batch = scenario
    _, overlapped = drive(sizes, versions, order, wakeups, k, micro_batch, overlap=True)
    _, batched = drive(sizes, versions, order, wakeups, k, micro_batch, overlap=False)
    assert [[s.sample_id for s in mb] for mb in overlapped] == [[s.sample_id for s in mb] for mb in batched]


def test_gate_rules():
    assert decisions.may_generate(batch=3, rollout_version=2, max_staleness=0)
    assert not decisions.may_generate(batch=3, rollout_version=1, max_staleness=0)
    assert decisions.may_generate(batch=3, rollout_version=1, max_staleness=1)
    assert decisions.may_start_episode(3, {"a": 2, "b": 2}, overlap=False)
    assert not decisions.may_start_episode(3, {"a": 2, "b": 1}, overlap=False)
    assert decisions.may_start_episode(3, {"a": 0, "b": 0}, overlap=True)


def test_a_micro_batch_takes_consecutive_whole_groups_as_many_as_fit_and_at_least_one():
    assert decisions.groups_in_micro_batch([4, 4, 4, 2, 8], 8) == 2
    assert decisions.groups_in_micro_batch([4, 2, 8], 8) == 2
    assert decisions.groups_in_micro_batch([10], 8) == 1
    assert decisions.groups_in_micro_batch([], 8) == 0


def test_the_store_takes_what_the_micro_batch_rule_says():
    store = ExperienceStore(["a"])
    for i, size in enumerate([4, 4, 4, 2, 8]):
        for s in store.open_group("a", f"g{i}", [1], size, BATCH):
            store.record_output(s.sample_id, [2], [-1.0], [BATCH - 1])
            store.set_reward(s.sample_id, float(len(s.sample_id) % 2))
    taken = [sorted({s.group_id for s in store.take("a", BATCH, 8)}) for _ in range(3)]
    assert taken == [["g0", "g1"], ["g2", "g3"], ["g4"]]


def test_the_step_is_due_once_the_batch_has_ended_and_nothing_ready_is_left():
    assert decisions.step_due(batch_complete=True, ready_samples=0)
    assert not decisions.step_due(batch_complete=True, ready_samples=3)
    assert not decisions.step_due(batch_complete=False, ready_samples=0)


def test_initial_placement_gives_every_agent_an_instance_and_spares_to_the_busiest():
    from flexmarl.controller.decisions import place_agents

    plan = place_agents(["a", "b", "c"], ["r0", "r1", "r2", "r3"], {"a": 1.0, "b": 10.0, "c": 2.0})
    assert plan == {"a": ["r0"], "b": ["r1", "r3"], "c": ["r2"]}
