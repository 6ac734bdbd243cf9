"""The pipeline's decision rules (controller/state/decisions.py) on plain data: staleness bound,
exactly-once, whole groups, and async micro-batches identical to sync ones for the same
arrival order, with micro-batches counted in samples or cut by a token budget."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flexmarl.controller.state import decisions
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.store import DROPPED, ExperienceStore, TurnSampling
from flexmarl.runtime.keys import GroupKey

BATCH = 6  # trains version 5 into 6
MicroBatchSize = decisions.MicroBatchSize


def key(i):
    return GroupKey("e", "a", f"g{i}")


def arrive(store, i, versions, lengths, rewards):
    """Group i's outputs (member j: `lengths[j]` ids by `versions[j]`), then its rewards."""
    store.record_group(key(i), output_of([[2] * n for n in lengths], [[-1.0] * n for n in lengths], list(versions)),
                       TurnSampling(0))
    store.set_group_rewards(key(i), rewards)


def ready(store, sizes, versions=None, lengths=None):
    """Groups of `sizes` members opened, generated and rewarded, in order."""
    for i, n in enumerate(sizes):
        store.open_group(key(i), [1, 1, 1], n, BATCH)
        arrive(store, i, versions[i] if versions else [BATCH - 1] * n, lengths[i] if lengths else [1] * n, [0.0] * n)


def calls(groups):
    return [g.key.call for g in groups]


@st.composite
def scenarios(draw):
    n_groups = draw(st.integers(1, 12))
    sizes = [draw(st.integers(1, 4)) for _ in range(n_groups)]
    versions = [[draw(st.integers(BATCH - 5, BATCH - 1)) for _ in range(s)] for s in sizes]
    order = draw(st.permutations(range(n_groups)))
    # after which arrivals the agent loop wakes up and forms micro-batches
    wakeups = draw(st.lists(st.booleans(), min_size=n_groups, max_size=n_groups))
    # Output lengths, and a micro-batch of 1-8 samples or of a 2-40 token budget.
    lengths = [[draw(st.integers(1, 9)) for _ in range(s)] for s in sizes]
    by_tokens = draw(st.booleans())
    size = MicroBatchSize(8, draw(st.integers(2, 40))) if by_tokens else MicroBatchSize(draw(st.integers(1, 8)))
    return sizes, versions, list(order), wakeups, draw(st.integers(0, 2)), (lengths, size)


def drive(sizes, versions, order, wakeups, k, shape, overlap):
    lengths, size = shape
    store = ExperienceStore(["a"])
    for i, n in enumerate(sizes):
        store.open_group(key(i), [1], n, BATCH)
    formed = []
    for i, wake in zip(order, wakeups):
        arrive(store, i, versions[i], lengths[i], [float(v % 2) for v in versions[i]])
        if wake:
            formed += store.form_micro_batches("a", BATCH, size, False, overlap, k)
    formed += store.form_micro_batches("a", BATCH, size, True, overlap, k)
    return store, formed


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_no_sample_older_than_k_is_ever_trained_over_random_arrival_orders(scenario):
    sizes, versions, order, wakeups, k, shape = scenario
    store, formed = drive(sizes, versions, order, wakeups, k, shape, overlap=True)
    assert all(decisions.lag(BATCH - 1, [v]) <= k for mb in formed for v in mb.oldest())
    keys = [k for mb in formed for k in mb.keys()]
    assert len(keys) == len(set(keys)), "a group was trained twice"
    assert all(mb.samples == sum(g.n for g in mb._groups) for mb in formed)  # whole groups
    for i, vs in enumerate(versions):
        stale = any(decisions.too_stale(BATCH - 1, [v], k) for v in vs)
        assert (key(i) not in keys) == stale
        assert all(v.status == DROPPED for v in store.views(key(i))) == stale
    size = shape[1]
    # Within the budget, unless one group alone is larger: 1 prompt token + the outputs.
    measured = [sum(g.size for g in mb._groups) if size.tokens else mb.samples for mb in formed]
    assert all(m <= size.limit or len(mb._groups) == 1 for m, mb in zip(measured, formed))


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_async_micro_batches_equal_sync_ones_for_the_same_arrival_order(scenario):
    sizes, versions, order, wakeups, k, shape = scenario
    _, overlapped = drive(sizes, versions, order, wakeups, k, shape, overlap=True)
    _, batched = drive(sizes, versions, order, wakeups, k, shape, overlap=False)
    assert [mb.keys() for mb in overlapped] == [mb.keys() for mb in batched]


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
    ready(store, [4, 4, 4, 2, 8])
    taken = [calls(store.take("a", BATCH, MicroBatchSize(8))) for _ in range(3)]
    assert taken == [["g0", "g1"], ["g2", "g3"], ["g4"]]


def test_a_token_budget_takes_whole_groups_by_their_prompt_once_and_every_output():
    store = ExperienceStore(["a"])
    # Group sizes in tokens: prompt 3 + outputs. g0: 3 + 2 + 2 = 7, g1: 3 + 5 = 8, g2: 3 + 20 = 23.
    ready(store, [2, 1, 1], lengths=[[2, 2], [5], [20]])
    budget = MicroBatchSize(samples=1, tokens=16)  # the sample count is then unused
    assert store.ready_size("a", BATCH, budget) == 38
    taken = [store.take("a", BATCH, budget) for _ in range(2)]
    assert [[g.size for g in groups] for groups in taken] == [[7, 8], [23]]
    taken = [calls(groups) for groups in taken]
    assert taken == [["g0", "g1"], ["g2"]]  # 7 + 8 fit in 16; g2 alone is larger, and still whole


def test_the_staleness_split_keeps_or_drops_whole_groups_and_changes_nothing_it_is_given():
    store = ExperienceStore(["a"])
    ready(store, [2, 2, 1], versions=[[BATCH - 1, BATCH - 1], [BATCH - 1, BATCH - 3], [BATCH - 2]])
    taken = store.take("a", BATCH, MicroBatchSize(8))
    before = [(g.key, g.status, g.oldest()) for g in taken]
    kept, stale = decisions.split_stale(taken, BATCH, max_staleness=1)
    assert calls(kept) == ["g0", "g2"]
    assert calls(stale) == ["g1"]  # one member two versions old: the whole group
    assert [(g.key, g.status, g.oldest()) for g in taken] == before
    assert store.count("a", DROPPED) == 0
    assert decisions.split_stale(taken, BATCH, max_staleness=2) == (taken, [])


def test_the_step_is_due_once_the_batch_has_ended_and_nothing_ready_is_left():
    assert decisions.step_due(batch_complete=True, ready_samples=0)
    assert not decisions.step_due(batch_complete=True, ready_samples=3)
    assert not decisions.step_due(batch_complete=False, ready_samples=0)


def test_initial_placement_gives_every_agent_an_instance_and_spares_to_the_busiest():
    from flexmarl.controller.state.decisions import place_agents

    plan = place_agents(["a", "b", "c"], ["r0", "r1", "r2", "r3"], {"a": 1.0, "b": 10.0, "c": 2.0})
    assert plan == {"a": ["r0"], "b": ["r1", "r3"], "c": ["r2"]}
