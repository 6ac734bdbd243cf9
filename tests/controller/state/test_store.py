import pytest

from flexmarl.controller.state.decisions import MicroBatchSize
from flexmarl.controller.state.store import CONSUMED, DROPPED, DuplicateResult, ExperienceStore, group_advantages


def fill(store, agent, group_id, rewards, version=0, batch=0):
    samples = store.open_group(agent, group_id, [1, 2], len(rewards), batch)
    for s, r in zip(samples, rewards):
        store.record_output(s.sample_id, [3], [-0.5], [version])
        store.set_reward(s.sample_id, r)
    return samples


def test_group_is_trainable_only_when_every_member_has_output_and_reward():
    store = ExperienceStore(["a"])
    samples = store.open_group("a", "g", [1], 3, 0)
    store.record_output(samples[0].sample_id, [2], [-1.0], [0])
    store.set_reward(samples[0].sample_id, 1.0)
    store.record_output(samples[1].sample_id, [2], [-1.0], [0])
    store.set_reward(samples[1].sample_id, 0.0)
    store.record_output(samples[2].sample_id, [2], [-1.0], [0])
    assert store.ready_samples("a", 0) == 0
    store.set_reward(samples[2].sample_id, 0.5)
    assert store.ready_samples("a", 0) == 3


def test_advantages_are_group_normalised():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]


def test_a_duplicated_result_is_refused_and_never_trained_twice():
    store = ExperienceStore(["a"])
    samples = fill(store, "a", "g", [1.0, 0.0])
    with pytest.raises(DuplicateResult):
        store.record_output(samples[0].sample_id, [9], [-0.1], [0])
    taken = store.take("a", 0, MicroBatchSize(100))
    assert [s.sample_id for s in taken] == [s.sample_id for s in samples]
    assert all(s.status == CONSUMED for s in taken)
    assert store.take("a", 0, MicroBatchSize(100)) == []
    with pytest.raises(DuplicateResult):
        store.record_output(samples[1].sample_id, [9], [-0.1], [0])


def test_take_returns_whole_groups_oldest_first():
    store = ExperienceStore(["a"])
    fill(store, "a", "g1", [1.0, 0.0, 0.5])
    fill(store, "a", "g2", [1.0, 0.0, 0.5])
    fill(store, "a", "g3", [1.0, 0.0, 0.5])
    first = store.take("a", 0, MicroBatchSize(4))  # a group is never split: 3 fit, the next 3 would not
    assert {s.group_id for s in first} == {"g1"}
    second = store.take("a", 0, MicroBatchSize(6))
    assert [s.group_id for s in second] == ["g2"] * 3 + ["g3"] * 3


def test_dropped_group_is_never_trained_and_counted():
    store = ExperienceStore(["a"])
    samples = store.open_group("a", "g", [1], 2, 0)
    store.record_output(samples[0].sample_id, [2], [-1.0], [0])
    store.drop_group("g", "episode failed")
    store.set_reward(samples[0].sample_id, 1.0)  # late reward for a dropped sample: ignored
    assert store.ready_samples("a", 0) == 0
    assert all(s.status == DROPPED for s in samples)
    assert store.counts[("a", DROPPED)] == 2


def test_unknown_agent_and_non_finite_reward_are_clear_errors():
    store = ExperienceStore(["a"])
    with pytest.raises(KeyError, match="unknown agent 'b'"):
        store.open_group("b", "g", [1], 1, 0)
    s = store.open_group("a", "g", [1], 1, 0)[0]
    store.record_output(s.sample_id, [2], [-1.0], [0])
    with pytest.raises(ValueError, match="not finite"):
        store.set_reward(s.sample_id, float("nan"))


def test_take_only_hands_out_groups_of_the_requested_global_batch():
    store = ExperienceStore(["a"])
    fill(store, "a", "old", [1.0, 0.0], batch=1)
    fill(store, "a", "new", [1.0, 0.0], batch=2)
    assert {s.group_id for s in store.take("a", 2, MicroBatchSize(100))} == {"new"}
    assert {s.group_id for s in store.take("a", 1, MicroBatchSize(100))} == {"old"}


def test_a_reward_after_the_group_completed_is_a_clear_error_not_silently_ignored():
    store = ExperienceStore(["a"])
    fill(store, "a", "g", [1.0, 0.0])
    with pytest.raises(ValueError, match="after its group was complete"):
        store.set_reward("g/0", 0.5)


def test_a_reward_set_twice_is_an_error():
    store = ExperienceStore(["a"])
    samples = store.open_group("a", "g", [1], 2, 0)
    store.record_output(samples[0].sample_id, [2], [-1.0], [0])
    store.set_reward(samples[0].sample_id, 1.0)
    with pytest.raises(ValueError, match="set twice"):
        store.set_reward(samples[0].sample_id, 0.0)


def test_advantages_skip_the_std_division_when_the_agent_asks_for_it():
    store = ExperienceStore(["a"], std_normalized={"a": False})
    fill(store, "a", "g", [1.0, 0.0, 0.5])
    assert [store.samples[f"g/{i}"].advantage for i in range(3)] == [0.5, -0.5, 0.0]
    normalized = ExperienceStore(["a"])
    fill(normalized, "a", "g", [1.0, 0.0, 0.5])
    assert normalized.samples["g/0"].advantage == pytest.approx(0.5 / (1 / 6) ** 0.5, rel=1e-5)


def test_user_code_sees_a_read_only_view_whose_lists_are_copies_and_a_later_turn_shows_through():
    import pytest

    from flexmarl.controller.state.groups import output_of

    store = ExperienceStore(["a"])
    store.open_group("a", "g", [1, 2], 2, 0)
    store.record_output("g/0", [3, 4], [-0.5, -0.25], [0])
    view = store.view("g/0")
    with pytest.raises(AttributeError):
        view.text = "edited"
    view.output_ids.append(99)  # a copy: the record is untouched
    assert view.output_ids == [3, 4] and view.mask == [1, 1] and view.versions == [0]
    store.record_turn("g/0", [5], output_of([[6]], [[-0.125]], 1))
    assert view.output_ids == [3, 4, 5, 6] and view.mask == [1, 1, 0, 1] and view.versions == [0, 1]
    assert view.logprobs == [-0.5, -0.25, 0.0, -0.125]  # held as float32 arrays, as vLLM computes them


def _opened_with_outputs(rewards_per_group):
    events = []
    store = ExperienceStore(["a"], emit=events.append)
    for g, rewards in enumerate(rewards_per_group):
        for s in store.open_group("a", f"g{g}", [1, 2], len(rewards), 0):
            store.record_output(s.sample_id, [3, 4], [-0.5, -0.25], [0])
    return store, events


def test_rewards_set_for_a_whole_group_do_what_setting_each_in_turn_does():
    rewards = [[1.0, 0.0, 0.5], [0.25, 0.25], [2.0, float("nan"), 1.0]]
    one_by_one, logged_one_by_one = _opened_with_outputs(rewards)
    whole, logged_whole = _opened_with_outputs(rewards)
    errors = []
    for g, values in enumerate(rewards):
        try:
            for sid, r in zip(one_by_one.groups[f"g{g}"].sample_ids, values):
                one_by_one.set_reward(sid, r)
        except ValueError as e:
            errors.append(str(e))
        try:
            whole.set_group_rewards(f"g{g}", values)
        except ValueError as e:
            errors.append(str(e))
    assert errors == ["reward for g2/1 is not finite: nan"] * 2
    assert logged_whole == logged_one_by_one and len(logged_whole) == 3 + 2  # opened, then complete
    fields = lambda s: (s.reward, s.advantage, s.status, s.ready_seq)  # noqa: E731
    assert [fields(s) for s in whole.samples.values()] == [fields(s) for s in one_by_one.samples.values()]
    assert whole.groups["g2"].rewarded == one_by_one.groups["g2"].rewarded == 1


def test_ready_size_counts_what_is_ready_in_samples_or_tokens_as_groups_arrive_and_are_taken():
    store = ExperienceStore(["a"])
    by_samples, by_tokens = MicroBatchSize(4), MicroBatchSize(4, tokens=7)

    def scanned(size):
        return sum(size.of_group(store.groups[g]) for g in store.ready["a"].get(0, ()))

    for g, rewards in enumerate([[1.0, 0.0], [1.0, 0.0, 0.5], [0.0, 1.0]]):
        fill(store, "a", f"g{g}", rewards)
        assert store.ready_size("a", 0, by_samples) == scanned(by_samples)
        assert store.ready_size("a", 0, by_tokens) == scanned(by_tokens)
    while store.ready_size("a", 0, by_samples):
        store.take("a", 0, by_samples)
        assert store.ready_size("a", 0, by_samples) == scanned(by_samples)
        assert store.ready_size("a", 0, by_tokens) == scanned(by_tokens)
    assert store.ready_size("a", 1, by_samples) == 0
