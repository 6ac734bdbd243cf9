import pytest

from flexmarl.controller.state import decisions
from flexmarl.controller.state.decisions import MicroBatchSize
from flexmarl.controller.state.groups import GroupOutput, output_of
from flexmarl.controller.state.store import (CONSUMED, DROPPED, READY, DuplicateResult, ExperienceStore, TurnSampling,
                                             group_advantages)
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey


def key(call, agent="a"):
    return GroupKey("e", agent, call)


def fill(store, agent, call, rewards, version=0, batch=0):
    k = key(call, agent)
    store.open_group(k, [1, 2], len(rewards), batch)
    store.record_group(k, output_of([[3]] * len(rewards), [[-0.5]] * len(rewards), version), TurnSampling(0))
    store.set_group_rewards(k, rewards)
    return k


def taken_calls(micro_batches):
    return [[g.call for g in mb.keys()] for mb in micro_batches]


def test_group_is_trainable_only_when_every_member_has_output_and_reward():
    store = ExperienceStore(["a"])
    g = key("g")
    store.open_group(g, [1], 3, 0)
    store.set_reward(g, 0, 1.0)
    store.set_reward(g, 1, 0.0)
    store.set_reward(g, 2, 0.5)
    assert store.ready_samples("a", 0) == 0  # rewarded, but no outputs yet
    store.record_group(g, output_of([[2]] * 3, [[-1.0]] * 3), TurnSampling(0))
    h = key("h")
    store.open_group(h, [1], 2, 0)
    store.record_group(h, output_of([[2]] * 2, [[-1.0]] * 2), TurnSampling(0))
    store.set_reward(h, 0, 1.0)
    assert store.ready_samples("a", 0) == 0
    store.set_reward(h, 1, 0.0)
    assert store.ready_samples("a", 0) == 2


def test_advantages_are_group_normalised():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]


def test_a_duplicated_result_is_refused_and_never_trained_twice():
    store = ExperienceStore(["a"])
    g = fill(store, "a", "g", [1.0, 0.0])
    with pytest.raises(DuplicateResult):
        store.record_group(g, output_of([[9]] * 2, [[-0.1]] * 2), TurnSampling(0))
    (mb,) = store.form_micro_batches("a", 0, MicroBatchSize(100), True, False, 0)
    assert mb.keys() == [g] and mb.samples == 2 and [v.status for v in store.views(g)] == [CONSUMED] * 2
    assert store.take("a", 0, MicroBatchSize(100)) == []
    with pytest.raises(DuplicateResult):
        store.record_group(g, output_of([[9]] * 2, [[-0.1]] * 2), TurnSampling(0))


def test_micro_batches_take_whole_groups_oldest_first():
    store = ExperienceStore(["a"])
    for call in ("g1", "g2", "g3"):
        fill(store, "a", call, [1.0, 0.0, 0.5])
    # a group is never split: 3 fit, the next 3 would not; the last 3 wait for a full micro-batch
    assert taken_calls(store.form_micro_batches("a", 0, MicroBatchSize(4), False, True, 0)) == [["g1"], ["g2"]]
    for call in ("g4", "g5"):
        fill(store, "a", call, [1.0, 0.0, 0.5])
    assert taken_calls(store.form_micro_batches("a", 0, MicroBatchSize(6), True, False, 0)) == [["g3", "g4"], ["g5"]]


def test_dropped_group_is_never_trained_and_counted():
    events = []
    store = ExperienceStore(["a"], emit=events.append)
    g = key("g")
    store.open_group(g, [1], 2, 0)
    store.drop_group(g, "episode failed")
    store.set_reward(g, 0, 1.0)  # late reward for a dropped sample: ignored
    assert store.ready_samples("a", 0) == 0
    assert all(v.status == DROPPED for v in store.views(g))
    assert store.count("a", DROPPED) == 2
    assert events[-1] == ev.SamplesDropped("a", ev.whole([(g, 2)]), "episode failed")


def test_unknown_agent_and_non_finite_reward_are_clear_errors():
    store = ExperienceStore(["a"])
    with pytest.raises(KeyError, match="unknown agent 'b'"):
        store.open_group(key("g", "b"), [1], 1, 0)
    store.open_group(key("g"), [1], 1, 0)
    with pytest.raises(ValueError, match="not finite"):
        store.set_reward(key("g"), 0, float("nan"))


def test_micro_batches_only_hold_groups_of_the_requested_global_batch():
    store = ExperienceStore(["a"])
    fill(store, "a", "old", [1.0, 0.0], batch=1)
    fill(store, "a", "new", [1.0, 0.0], batch=2)
    assert taken_calls(store.form_micro_batches("a", 2, MicroBatchSize(100), True, False, 9)) == [["new"]]
    assert taken_calls(store.form_micro_batches("a", 1, MicroBatchSize(100), True, False, 9)) == [["old"]]


def test_a_reward_after_the_group_completed_is_a_clear_error_not_silently_ignored():
    store = ExperienceStore(["a"])
    g = fill(store, "a", "g", [1.0, 0.0])
    with pytest.raises(ValueError, match="e/a-g/0 arrived after its group was complete"):
        store.set_reward(g, 0, 0.5)


def test_a_reward_set_twice_is_an_error():
    store = ExperienceStore(["a"])
    g = key("g")
    store.open_group(g, [1], 2, 0)
    store.set_reward(g, 0, 1.0)
    with pytest.raises(ValueError, match="set twice"):
        store.set_reward(g, 0, 0.0)


def test_advantages_skip_the_std_division_when_the_agent_asks_for_it():
    store = ExperienceStore(["a"], std_normalized={"a": False})
    fill(store, "a", "g", [1.0, 0.0, 0.5])
    normalized = ExperienceStore(["a"])
    fill(normalized, "a", "g", [1.0, 0.0, 0.5])
    plain = store.form_micro_batches("a", 0, MicroBatchSize(9), True, False, 0)[0].wire()[0]
    scaled = normalized.form_micro_batches("a", 0, MicroBatchSize(9), True, False, 0)[0].wire()[0]
    assert plain.advantages == [0.5, -0.5, 0.0]
    assert scaled.advantages[0] == pytest.approx(0.5 / (1 / 6) ** 0.5, rel=1e-5)


def test_user_code_sees_a_read_only_view_and_a_later_turn_shows_through():
    store = ExperienceStore(["a"])
    g = key("g")
    store.open_group(g, [1, 2], 2, 0)
    store.record_group(g, output_of([[3, 4], [7]], [[-0.5, -0.25], [-1.0]], 0, worker="r0"), TurnSampling(0))
    view = store.view(g, 0)
    with pytest.raises(AttributeError):
        view.text = "edited"
    with pytest.raises(TypeError):
        view.output_ids[0] = 99  # read-only by type
    before = view.output_ids
    assert view.output_ids.tolist() == [3, 4] and view.mask.tolist() == [1, 1] and view.versions == [0]
    context, instance, turn = store.turn_context(g, 0, [5])
    assert (context, instance, turn) == ([1, 2, 3, 4, 5], "r0", 1)
    store.record_turn(g, 0, [5], output_of([[6]], [[-0.125]], 1, worker="r1"), TurnSampling(0, 0.5))
    assert view.output_ids.tolist() == [3, 4, 5, 6] and view.mask.tolist() == [1, 1, 0, 1] and view.versions == [0, 1]
    assert view.logprobs.tolist() == [-0.5, -0.25, 0.0, -0.125]  # held as float32, as vLLM computes them
    assert view.token_versions.tolist() == [0, 0, 1, 1]  # appended ids carry their turn's version
    assert [x.tolist() for x in view.last_turn] == [[6], [-0.125]]
    assert store.view(g, 1).output_ids.tolist() == [7] and store.view(g, 1).versions == [0]  # the other member unmoved
    assert before.tolist() == [3, 4]  # a view taken earlier still reads what it read: buffers are never changed
    assert store.turn_context(g, 0, [])[1:] == ("r1", 2)


def test_a_view_reads_the_stored_buffers_without_copying_them():
    """`last_turn` of a 4,096-token, 8-choice reply: every property a slice of the record's
    buffers, whatever the size (no copy; the timings are in bench/micro/group_record.py)."""
    store = ExperienceStore(["a"])
    g = key("g")
    tokens = [[(7 * j + i) % 50 for i in range(4096)] for j in range(8)]
    store.open_group(g, list(range(10)), 8, 0)
    store.record_group(g, output_of(tokens, [[-0.5] * 4096] * 8), TurnSampling(0))
    group = store._groups[g]  # the test looks inside the record it checks
    for j, view in enumerate(store.views(g)):
        ids, logprobs = view.last_turn
        for got, buffer in ((ids, group.tokens), (logprobs, group.logprobs), (view.output_ids, group.tokens),
                            (view.prompt_ids, group.prompt), (view.token_versions, group.versions)):
            assert isinstance(got, memoryview) and got.readonly and got.obj is buffer
        assert ids[-1] == tokens[j][-1] and len(ids) == 4096 and isinstance(view.mask, memoryview)


def test_rewards_set_for_a_whole_group_do_what_setting_each_in_turn_does():
    rewards = [[1.0, 0.0, 0.5], [0.25, 0.25], [2.0, float("nan"), 1.0]]
    stores = []
    errors = []
    for whole in (False, True):
        events = []
        store = ExperienceStore(["a"], emit=events.append)
        for g, values in enumerate(rewards):
            k = key(f"g{g}")
            store.open_group(k, [1, 2], len(values), 0)
            store.record_group(k, output_of([[3, 4]] * len(values), [[-0.5, -0.25]] * len(values)), TurnSampling(0))
            try:
                if whole:
                    store.set_group_rewards(k, values)
                else:
                    for j, r in enumerate(values):
                        store.set_reward(k, j, r)
            except ValueError as e:
                errors.append(str(e))
        stores.append((store, events))
    assert errors == ["reward for e/a-g2/1 is not finite: nan"] * 2
    (one_by_one, logged_one_by_one), (whole, logged_whole) = stores
    assert logged_whole == logged_one_by_one and len(logged_whole) == 3 + 2  # opened, then complete
    fields = lambda v: (v.reward, v.status)  # noqa: E731
    for g in range(3):
        assert [fields(v) for v in whole.views(key(f"g{g}"))] == [fields(v) for v in one_by_one.views(key(f"g{g}"))]


def test_ready_size_counts_what_is_ready_in_samples_or_tokens_as_groups_arrive_and_are_taken():
    store = ExperienceStore(["a"])
    by_samples, by_tokens = MicroBatchSize(4), MicroBatchSize(4, tokens=7)
    ready = {}  # group -> its size in samples, in tokens (its prompt of 2 once, each output of 1)
    for g, rewards in enumerate([[1.0, 0.0], [1.0, 0.0, 0.5], [0.0, 1.0]]):
        ready[fill(store, "a", f"g{g}", rewards)] = (len(rewards), 2 + len(rewards))
        assert store.ready_size("a", 0, by_samples) == sum(n for n, _ in ready.values())
        assert store.ready_size("a", 0, by_tokens) == sum(t for _, t in ready.values())
    while store.ready_size("a", 0, by_samples):
        for taken in store.take("a", 0, by_samples):
            del ready[taken.key]
        assert store.ready_size("a", 0, by_samples) == sum(n for n, _ in ready.values())
        assert store.ready_size("a", 0, by_tokens) == sum(t for _, t in ready.values())
    assert store.ready_size("a", 1, by_samples) == 0


def test_a_micro_batch_goes_to_the_trainer_as_groups_the_prompt_once_and_packed():
    store = ExperienceStore(["a"])
    g = key("g")
    store.open_group(g, [1, 2, 3], 2, 1)
    store.record_group(g, output_of([[5, 6], [7]], [[-0.5, -0.25], [-1.0]], [0, 1]), TurnSampling(0, 0.7, 0.9, 5))
    store.record_turn(g, 1, [8], output_of([[9]], [[-0.125]], 1), TurnSampling(0, 0.3, 1.0, 4))
    store.set_group_rewards(g, [1.0, 0.0])
    (mb,) = store.form_micro_batches("a", 1, MicroBatchSize(4), True, False, 1)
    (sent,) = mb.wire()
    assert (sent.key, sent.lengths, sent.versions) == (g, [2, 3], [0, 1])
    assert protocol.unpacked("i", sent.prompt_ids).tolist() == [1, 2, 3]
    assert protocol.unpacked("i", sent.output_ids).tolist() == [5, 6, 7, 8, 9]
    assert protocol.unpacked("f", sent.rollout_logprobs).tolist() == [-0.5, -0.25, -1.0, 0.0, -0.125]
    assert list(sent.loss_mask) == [1, 1, 1, 0, 1] and len(sent.advantages) == 2
    assert (sent.temperature, sent.top_p, sent.top_k) == (0.7, 0.9, 5)
    assert sent.turns == [protocol.MemberTurn(1, 2, 0.3, 1.0, 4)]  # member 1's second turn from its output id 2
    assert mb.oldest() == [0, 1] and mb.parts() == ev.whole([(g, 2)])


def test_what_a_checkpoint_leaves_out_is_asked_of_the_store():
    store = ExperienceStore(["a", "b"])
    fill(store, "a", "g", [1.0, 0.0], batch=2)
    store.open_group(key("h", "b"), [1], 3, 3)
    store.open_group(key("i", "b"), [1], 2, 1)
    assert store.samples_past(1) == {"a": 2, "b": 3} and store.samples_past(3) == {}


def spanning_output(key_, lengths, version, token_versions):
    """One part whose members' tokens carry `token_versions` (a load let the request continue)."""
    ids = [[5] * n for n in lengths]
    result = protocol.GroupResult(key_, 0, version, list(lengths),
                                  protocol.packed(protocol.TOKEN_TYPECODE, [t for i in ids for t in i]),
                                  protocol.packed(protocol.LOGPROB_TYPECODE, [-0.5] * sum(lengths)),
                                  ["length"] * len(lengths),
                                  token_versions=protocol.packed(protocol.TOKEN_TYPECODE, token_versions))
    return GroupOutput([(result, "r0")])


def test_a_sample_whose_tokens_span_two_versions_records_both_and_is_gated_by_its_oldest():
    from flexmarl.controller.state import decisions

    store = ExperienceStore(["a"])
    g = key("g")
    store.open_group(g, [1, 2], 3, 0)
    # Admitted under 4; a sync to 5 came after member 0's second token and member 1's first;
    # member 2 had not started (all its tokens are 5's).
    store.record_group(g, spanning_output(g, [4, 3, 2], 4, [4, 4, 5, 5, 4, 5, 5, 5, 5]), TurnSampling(0))
    views = store.views(g)
    assert [v.token_versions.tolist() for v in views] == [[4, 4, 5, 5], [4, 5, 5], [5, 5]]
    assert [v.versions for v in views] == [[4], [4], [4]]  # the turn: the version it was admitted under
    store.set_group_rewards(g, [1.0, 0.0, 0.5])
    (group,) = store.take("a", 0, MicroBatchSize(8))
    assert group.oldest() == [4, 4, 5] and group.train_group().versions == [4, 4, 5]
    assert decisions.split_stale([group], 6, max_staleness=1) == ([group], [])  # trains 5 - 4 = 1: kept
    assert decisions.split_stale([group], 7, max_staleness=1) == ([], [group])  # trains 6: its oldest is 2 old


def test_a_member_whose_tokens_all_came_after_the_sync_counts_their_version_not_its_admission():
    store = ExperienceStore(["a"])
    g = key("g")
    store.open_group(g, [1], 2, 0)
    store.record_group(g, spanning_output(g, [2, 2], 3, [3, 4, 4, 4]), TurnSampling(0))
    store.set_group_rewards(g, [1.0, 0.0])
    (group,) = store.take("a", 0, MicroBatchSize(8))
    assert group.oldest() == [3, 4] and group.spanned() == [3, 4]


def test_the_event_logs_oldest_tokens_refill_a_store_that_gates_the_same():
    live, again = ExperienceStore(["a"]), ExperienceStore(["a"])
    g = key("g")
    for store in (live, again):
        store.open_group(g, [1], 2, 0)
    live.record_group(g, spanning_output(g, [2, 2], 3, [3, 4, 4, 4]), TurnSampling(0))
    again.record_versions(g, 0, 2, 3, [3, 4])  # what RequestsCompleted.oldest says of the part
    for store in (live, again):
        store.set_group_rewards(g, [1.0, 0.0], size=5)
    assert [gr.oldest() for gr in live.take("a", 0, MicroBatchSize(8))] == \
        [gr.oldest() for gr in again.take("a", 0, MicroBatchSize(8))] == [[3, 4]]


def test_a_carried_over_group_trains_once_in_the_batch_its_episode_ends_in_its_tokens_spanning_two_versions():
    store = ExperienceStore(["a"], assigned_at_end=True)
    fast, slow = GroupKey("s1q0", "a", "g"), GroupKey("s1q1", "a", "g")
    for k in (fast, slow):
        store.open_group(k, [1], 2, 1)  # both started as batch 1's, under version 0
    store.record_group(fast, spanning_output(fast, [2, 2], 0, [0, 0, 0, 0]), TurnSampling(0))
    store.set_group_rewards(fast, [1.0, 0.0])
    assert store.ready_samples("a", 1) == 0  # held until its episode's batch is named
    store.assign([fast], 1)
    # The slow one ran on across the sync to version 1: its tokens are 0's then 1's.
    store.record_group(slow, spanning_output(slow, [3, 2], 0, [0, 1, 1, 0, 1]), TurnSampling(0))
    store.set_group_rewards(slow, [0.5, 0.0])
    store.assign([slow], 2)  # batch 1 was full when it ended: it carries over
    size = MicroBatchSize(8)
    (first,) = store.form_micro_batches("a", 1, size, True, True, max_staleness=1)
    assert first.keys() == [fast]
    (second,) = store.form_micro_batches("a", 2, size, True, True, max_staleness=1)
    assert second.keys() == [slow] and second.oldest() == [0, 0]  # trains version 1: lag 1, kept
    assert store.views(slow)[0].token_versions.tolist() == [0, 1, 1]
    assert store.form_micro_batches("a", 2, size, True, True, max_staleness=1) == []
    assert store.count("a", "consumed") == 4 and store.count("a", "dropped") == 0


def test_a_carried_over_group_too_stale_by_its_oldest_token_is_dropped_and_counted():
    store = ExperienceStore(["a"], assigned_at_end=True)
    slow = GroupKey("s2q0", "a", "g")
    store.open_group(slow, [1], 2, 2)  # admitted under version 0 (batch 2 allows it with K = 1)
    store.record_group(slow, spanning_output(slow, [2, 2], 0, [0, 1, 1, 2]), TurnSampling(0))
    store.set_group_rewards(slow, [1.0, 0.0])
    store.assign([slow], 3)  # carried into batch 3, which trains version 2: its oldest token is 2 old
    assert store.form_micro_batches("a", 3, MicroBatchSize(8), True, True, max_staleness=1) == []
    assert store.count("a", "dropped") == 2 and store.count("a", "consumed") == 0


def test_an_abandoned_episodes_groups_are_dropped_whether_trainable_or_still_generating():
    events = []
    store = ExperienceStore(["a"], emit=events.append, assigned_at_end=True)
    done = fill(store, "a", "done", [1.0, 0.0], batch=1)  # trainable, held until its episode's batch is named
    running = key("running")
    store.open_group(running, [1], 2, 1)
    store.abandon([done, running, key("never-opened")], decisions.ABANDONED)
    assert store.count("a", DROPPED) == 4
    assert [e for e in events if isinstance(e, ev.SamplesDropped)] == [
        ev.SamplesDropped("a", ev.whole([(done, 2)]), decisions.ABANDONED),
        ev.SamplesDropped("a", ev.whole([(running, 2)]), decisions.ABANDONED)]
    store.assign([done, running], 1)  # too late: no batch takes them
    assert store.ready_samples("a", 1) == 0
    assert store.form_micro_batches("a", 1, MicroBatchSize(2), True, True, 1) == []


def test_a_groups_columns_are_untracked_by_the_collector():
    """What a group in flight keeps (its columns, per member) is not walked by every young
    pass of the collector: bytes and tuples of strings, no array.array or lists."""
    import gc

    store = ExperienceStore(["a"])
    g = key("g")
    store.open_group(g, [1, 2], 2, 0)
    store.record_group(g, output_of([[3, 4], [5]], [[-0.5, -0.1], [-0.2]], 1), TurnSampling(0))
    store.set_reward(g, 0, 1.0)
    record = store._group(g)
    assert [record.reward(0), record.reward(1)] == [1.0, None] and record.firsts() == [1, 1]
    assert record.span(1) == (2, 3) and record.lengths() == [2, 1] and record.output_size() == 3
    store.set_reward(g, 1, 0.0)
    assert record.advantages_list() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert record.settled_oldest is None and record.oldest() == [1, 1]  # first turns only: read from them
    gc.collect()  # a tuple of untracked items is untracked by the first pass that sees it
    columns = [record.offsets, record.first, record.rewards, record.advantages, record.finish_reasons,
               record.served_by, record.prompt, record.tokens, record.logprobs, record.versions, record.settled_oldest]
    assert [name for name, c in zip("offsets first rewards advantages finish_reasons served_by prompt tokens "
                                    "logprobs versions settled_oldest".split(), columns) if gc.is_tracked(c)] == []
    assert not gc.is_tracked(record)
    h = key("h")
    store.open_group(h, [1, 2], 2, 0)
    store.record_group(h, output_of([[3], [5]], [[-0.5], [-0.2]], 1), TurnSampling(0))
    other = store._group(h)
    # One instance's, and equal finish reasons: tuples shared by the groups, none made per group.
    assert other.served_by is record.served_by and other.finish_reasons is record.finish_reasons
