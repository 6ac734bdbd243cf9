"""controller/view/episodes.py: every sample and its episode, from events written as the
controller writes them (no processes)."""

import math

import pytest

from flexmarl.controller.state.store import group_advantages
from flexmarl.controller.view.episodes import EpisodeIndex
from flexmarl.runtime import events as ev
from flexmarl.runtime import legacy_events as old
from flexmarl.runtime.keys import GroupKey


def stamped(*events):
    for i, e in enumerate(events):
        e.seq, e.t = i, float(i)
    return list(events)


def one_episode():
    """Episode s1q0: a planner group of 4 (branch ()), a solver group per plan (branches
    (0,) and (1,)), the solver's second group split over two instances; a conversation's
    later turn on another instance; step 1 taken for both agents, one group dropped."""
    plan, solve0, solve1 = (GroupKey("s1q0", "planner", "0000000a-0"), GroupKey("s1q0", "solver", "0000000b-b0-0"),
                            GroupKey("s1q0", "solver", "0000000c-b1-0"))
    return stamped(
        ev.GroupOpened(plan, 1, 4),
        ev.RequestsDispatched("rollout-0", "planner", 1, 6, ev.Parts([plan], [0], [4])),
        ev.RequestsCompleted("rollout-0", "planner", 1, [0], 8, parts=ev.Parts([plan], [0], [4])),
        ev.GroupComplete(plan, [1.0, 0.0, 0.5, 0.5]),
        ev.GroupOpened(solve0, 1, 2),
        ev.GroupOpened(solve1, 1, 2),
        ev.RequestsCompleted("rollout-1", "solver", 2, [0, 0], 8, parts=ev.Parts([solve0, solve1], [0, 0], [2, 1])),
        ev.RequestsCompleted("rollout-2", "solver", 3, [1], 4, parts=ev.Parts([solve1], [1], [1])),
        ev.RequestsCompleted("rollout-2", "solver", 4, [1], 4, parts=ev.Parts([solve0], [1], [1], [1])),  # member 1's second turn
        ev.GroupComplete(solve0, [0.25, 0.75]),
        ev.SamplesDropped("solver", ev.whole([(solve1, 2)]), "episode failed: boom"),
        ev.MicroBatchFormed("planner", "trainer-0", 1, ev.whole([(plan, 4)]), [0] * 4),
        ev.MicroBatchFormed("solver", "trainer-0", 1, ev.whole([(solve0, 2)]), [0, 0]),
        ev.OptimizerStep("planner", "trainer-0", 1, 4),
    )


def test_each_sample_gets_its_instance_version_reward_advantage_and_what_became_of_it():
    index = EpisodeIndex(lambda offset: None)
    events = one_episode()
    index.read(events[:7])  # the log read in two parts, as a growing log is
    index.read(events[7:])
    rows = {r["sample"]: r for r in index.rows(index.select())}
    assert len(rows) == 8 and index.episodes == ["s1q0"]
    plan = [rows[f"s1q0/planner-0000000a-0/{i}"] for i in range(4)]
    assert [r["reward"] for r in plan] == [1.0, 0.0, 0.5, 0.5]
    assert [r["advantage"] for r in plan] == [round(a, 4) for a in group_advantages([1.0, 0.0, 0.5, 0.5])]
    assert {(tuple(r["versions"]), tuple(r["instances"]), r["status"], r["trained_into"]) for r in plan} == {
        ((0,), ("rollout-0",), "trained", 1)}
    solve0 = [rows[f"s1q0/solver-0000000b-b0-0/{i}"] for i in range(2)]
    assert [r["status"] for r in solve0] == ["in micro-batch", "in micro-batch"]  # its step is not logged yet
    assert solve0[1]["versions"] == [0, 1] and solve0[1]["instances"] == ["rollout-1", "rollout-2"]  # two turns
    solve1 = [rows[f"s1q0/solver-0000000c-b1-0/{i}"] for i in range(2)]
    assert [r["instances"] for r in solve1] == [["rollout-1"], ["rollout-2"]]  # the group's two parts
    assert [r["versions"] for r in solve1] == [[0], [1]]
    assert {r["status"] for r in solve1} == {"dropped"} and solve1[0]["dropped"] == "episode failed: boom"
    assert solve1[0]["reward"] is None and solve1[0]["advantage"] is None
    index.read(stamped(ev.OptimizerStep("solver", "trainer-0", 1, 2)))
    assert {r["status"] for r in index.rows(index.select(agent="solver", status="trained"))} == {"trained"}


def test_the_list_filters_by_agent_step_reward_status_and_text_and_orders_by_reward():
    index = EpisodeIndex(lambda offset: None)
    index.read(one_episode())
    later = GroupKey("s2q0", "planner", "0000000d-0")
    index.read(stamped(ev.GroupOpened(later, 2, 2), ev.GroupComplete(later, [0.9, 0.1])))

    def samples(**filters):
        return [f"{r['agent']}/{r['member']}" for r in index.rows(index.select(**filters))]

    assert len(samples()) == 10
    assert len(samples(agent="solver")) == 4 and samples(agent="nobody") == []
    assert samples(steps=(2, None)) == ["planner/0", "planner/1"]
    assert len(samples(steps=(None, 1))) == 8
    assert samples(agent="planner", rewards=(0.5, 0.95), order="-reward") == ["planner/0", "planner/2", "planner/3"]
    assert samples(agent="planner", order="reward")[:2] == ["planner/1", "planner/1"]  # 0.0 in step 1, 0.1 in step 2
    assert len(samples(status="dropped")) == 2 and len(samples(status="ready")) == 2
    assert samples(with_text=True) == []
    index.add_text(123, {"sample_id": f"{later}/1", "group": ["s2q0", "planner", "0000000d-0"], "member": 1,
                         "turns": []})
    assert samples(with_text=True) == ["planner/1"]
    index.add_text(124, {"sample_id": "s1q0/planner-0000000a-0/3", "agent": "planner", "turns": []})  # an older line: its id alone
    assert samples(with_text=True) == ["planner/3", "planner/1"]


def test_an_episode_opens_as_its_groups_with_branches_and_the_recorded_texts_of_its_members():
    texts = {7: {"sample_id": "s1q0/solver-0000000b-b0-0/1", "group": ["s1q0", "solver", "0000000b-b0-0"], "member": 1,
                 "versions": [0, 1],
                 "turns": [{"role": "user", "text": "sort 3 1 2"}, {"role": "assistant", "text": "1 2 3", "version": 0}]}}
    index = EpisodeIndex(texts.get)
    index.add_text(7, texts[7])  # the line came before the log named its group
    index.read(one_episode())
    episode = index.episode("s1q0")
    assert [(g["agent"], g["branch"], len(g["members"])) for g in episode["groups"]] == [
        ("planner", [], 4), ("solver", [0], 2), ("solver", [1], 2)]
    member = episode["groups"][1]["members"][1]
    assert member["turns"] == texts[7]["turns"] and member["text"] is True
    assert "turns" not in episode["groups"][1]["members"][0]
    assert index.episode("s9q9") is None


def test_format_one_logs_that_list_every_sample_are_read_too():
    group = "s1q0/a-0000000a-0"
    index = EpisodeIndex(lambda offset: None)
    legacy = old.LegacyReader()  # what the event log's reader does with an old log's frames
    index.read([legacy(e) for e in stamped(
        old.GroupOpened("a", group, [f"{group}/0", f"{group}/1"], 1),
        old.RequestsCompleted("r0", "a", 1, [f"{group}/0", f"{group}/1"], [3, 4], 2),
        old.GroupComplete("a", group, [0.0, 1.0]))])
    rows = index.rows(index.select())
    assert [(r["versions"], r["instances"], r["reward"]) for r in rows] == [([3], ["r0"], 0.0), ([4], ["r0"], 1.0)]


def test_a_resumed_run_that_opens_a_group_again_starts_its_members_afresh():
    group = GroupKey("s2q0", "a", "0000000a-0")
    index = EpisodeIndex(lambda offset: None)
    index.read(stamped(ev.GroupOpened(group, 2, 2), ev.GroupComplete(group, [0.0, 1.0]),
                       ev.MicroBatchFormed("a", "t", 2, ev.whole([(group, 2)]), [1, 1]),
                       ev.OptimizerStep("a", "t", 2, 2),
                       ev.RunResumed(1, "checkpoints/step-000001", ""), ev.GroupOpened(group, 2, 2)))
    rows = index.rows(index.select())
    assert len(rows) == 2 and {(r["status"], r["reward"]) for r in rows} == {("opened", None)}


def test_std_normalisation_follows_the_agents_setting():
    group = GroupKey("s1q0", "a", "0000000a-0")
    index = EpisodeIndex(lambda offset: None, std_normalized=lambda agent: False)
    index.read(stamped(ev.GroupOpened(group, 1, 2), ev.GroupComplete(group, [0.0, 1.0])))
    assert [r["advantage"] for r in index.rows(index.select())] == [-0.5, 0.5]
    assert not math.isnan(index.s_reward.view()[0])


GROUP = GroupKey("s1q0", "a", "0000000a-0")


@pytest.mark.parametrize("bad", [ev.Parts([GROUP], [9], [1]), ev.Parts([GROUP], [2], [3]),
                                 ev.Parts([GroupKey("nothing", "a", "0")], [0], [1]),
                                 ev.Parts([GROUP], [0], [1], [1])])  # a later turn is no member of a micro-batch
def test_a_part_of_no_opened_member_is_passed_over(bad):
    index = EpisodeIndex(lambda offset: None)
    index.read(stamped(ev.GroupOpened(GROUP, 1, 2), ev.MicroBatchFormed("a", "t", 1, bad, [0]),
                       ev.SamplesDropped("a", bad, "x")))
    assert {r["status"] for r in index.rows(index.select())} == {"opened"}
