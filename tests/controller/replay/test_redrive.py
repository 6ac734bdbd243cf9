"""The re-drive of `flexmarl replay --check` (redrive.py): a log naming its completions
compactly (parts of groups) re-drives as one naming every sample, and the agents re-driven
in two shares, one in a forked child beside the summary, make the whole re-drive."""

import os

import msgspec
import pytest

from flexmarl.controller import replay
from flexmarl.controller.replay import checking
from flexmarl.controller.replay import redrive
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import dump_toml, load_config
from flexmarl.runtime.keys import GroupKey


def K(call, agent="a"):
    return GroupKey("s1q0", agent, call)


def split_group_run():
    """Agent a, K = 1, micro-batches of 4: group g1 (4 members) of batch 1 completes in two
    parts from two instances, g2 (2 members) whole, each member of g1's second part generated
    by version 1 (a later sync); a later turn of g2's first member comes back too."""
    cfg = load_config(None, ["pipeline.micro_batch=4", "agents.a.model='m'"], defaults={})

    def completed(worker, request, group, first, size, version, turn=0):
        return ev.RequestsCompleted(worker, "a", request, [version], size,
                                    parts=ev.Parts([K(group)], [first], [size], [turn] if turn else []))

    events = [ev.RunStarted(dump_toml(cfg), ["a"], "async", 1, 0),
              ev.GroupOpened(K("g1"), 1, 4), ev.GroupOpened(K("g2"), 1, 2),
              completed("r1", 2, "g1", 2, 2, 1), completed("r0", 1, "g1", 0, 2, 0), completed("r0", 3, "g2", 0, 2, 0),
              completed("r0", 4, "g9", 0, 2, 0),  # a group this lineage never opened: nothing to record
              completed("r0", 9, "g2", 0, 1, 1, turn=1),  # g2's member 0, its second turn
              ev.GroupComplete(K("g2"), [1.0, 0.0], 6), ev.GroupComplete(K("g1"), [1.0, 0.0, 0.5, 0.5], 12)]
    for seq, e in enumerate(events):
        e.seq, e.t = seq, float(seq)
    return events


def test_a_group_completed_in_parts_by_two_versions_is_redriven_member_by_member():
    formed = [e for e in redrive.redrive(split_group_run()) if type(e) is ev.MicroBatchFormed]
    assert [(e.parts, e.min_versions) for e in formed] == [
        (ev.whole([(K("g2"), 2)]), [0, 0]), (ev.whole([(K("g1"), 4)]), [0, 0, 1, 1])]  # each member its part's version


def test_the_store_records_a_part_once_and_keeps_a_members_first_turn():
    from flexmarl.controller.state.store import ExperienceStore

    store = ExperienceStore(["a"])
    store.open_group(K("g"), [], 3, 1)
    store.record_versions(K("g"), 1, 5, 2)  # a part reaching past the group's end: its members only
    store.record_versions(K("g"), 0, 2, 7)  # member 1 already has its first turn: kept
    assert [v.versions for v in store.views(K("g"))] == [[7], [2], [2]]
    store.set_group_rewards(K("g"), [1.0, 0.0, 0.5], size=9)
    assert store.ready_samples("a", 1) == 3


def test_the_forked_check_answers_as_the_check_in_this_process_does():
    agreeing = split_group_run()
    for e in redrive.redrive(agreeing):
        e.seq, e.t = len(agreeing), agreeing[-1].t
        agreeing.append(e)
    differing = agreeing[:-2] + [ev.MicroBatchFormed("a", "", 1, ev.Parts([K("g1")], [0], [1]), [0])] + agreeing[-1:]
    for events in (agreeing, differing):
        assert replay.check_beside(events)() == replay.check(events)
    assert replay.check(agreeing) is None and "differs" in replay.check(differing)


def test_the_check_runs_in_this_process_on_one_core_or_when_its_child_dies(monkeypatch):
    events = split_group_run()
    children = []
    monkeypatch.setattr(checking, "_decisions_into", lambda *args: os._exit(3))  # dies without answering
    real_start = __import__("multiprocessing").context.ForkProcess.start
    monkeypatch.setattr("multiprocessing.context.ForkProcess.start",
                        lambda self: children.append(self) or real_start(self))
    expected = replay.check(events)
    assert replay.check_beside(events)() == expected
    assert len(children) == 1 and children[0].exitcode == 3  # it ran, died, and its share was re-driven here
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert replay.check_beside(events)() == expected
    assert len(children) == 1  # one core: no child


def test_a_redrive_that_raises_in_the_child_raises_here_once_with_no_traceback_from_the_child(monkeypatch, capfd):
    real = redrive.training_decisions

    def broken(log, agents):
        if "a" in agents:  # the child's share (the one agent)
            raise RuntimeError("re-drive broke")
        return real(log, agents)

    monkeypatch.setattr(redrive, "training_decisions", broken)  # the forked child has it too
    waiting = replay.check_beside(split_group_run())
    with pytest.raises(RuntimeError, match="re-drive broke"):
        waiting()
    assert "Traceback" not in capfd.readouterr().err


def agents_run(agents, groups_each):
    """Every agent of `agents` opens `groups_each[agent]` groups of 2 in batch 1, each
    generated by version 0 and rewarded, in turns across the agents; then the decisions
    the re-drive makes of them, logged as the controller would."""
    cfg = load_config(None, ["pipeline.micro_batch=2"] + [f"agents.{a}.model='m'" for a in agents], defaults={})
    events = [ev.RunStarted(dump_toml(cfg), list(agents), "async", 1, 0)]
    for i in range(max(groups_each.values())):
        for a in agents:
            if i < groups_each[a]:
                g = K(f"{a}{i}", a)
                events += [ev.GroupOpened(g, 1, 2), ev.RequestsCompleted(
                    "r0", a, i, [0], 4, parts=ev.Parts([g], [0], [2])), ev.GroupComplete(g, [1.0, 0.0], 6)]
    events += redrive.redrive(events)
    for seq, e in enumerate(events):
        e.seq, e.t = seq, float(seq)
    return events


def test_the_agents_redriven_in_two_shares_and_joined_are_the_whole_redrive_and_a_wrong_decision_in_either_is_found():
    agents = ["a", "b", "c", "d"]
    events = agents_run(agents, {"a": 9, "b": 5, "c": 3, "d": 1})
    theirs, mine = checking._shares(events, agents)
    assert theirs and mine and sorted(theirs + mine) == agents  # both processes re-drive some
    counted = redrive.lineage(events)
    made = {**redrive.training_decisions(counted, theirs), **redrive.training_decisions(counted, mine)}
    joined = redrive.in_log_order(counted, {a: made[a] for a in agents}, redrive.balancer_moves(counted))
    assert joined == redrive.redrive(events)
    assert replay.check_beside(events)() is None
    for agent in (theirs[0], mine[0]):  # a decision of the child's share, one of this process's
        wrong = with_first_micro_batch_of(events, agent, ev.Parts([K(f"{agent}0", agent)] * 2, [1, 0], [1, 1]))
        found = replay.check_beside(wrong)()
        assert found == replay.check(wrong) and f"Parts(s1q0/{agent}-{agent}0/1, s1q0/{agent}-{agent}0/0)" in found


def with_first_micro_batch_of(events, agent, parts):
    """`events` with `agent`'s first logged micro-batch naming `parts` instead."""
    out, changed = [], False
    for e in events:
        if not changed and type(e) is ev.MicroBatchFormed and e.agent == agent:
            e, changed = msgspec.structs.replace(e, parts=parts), True
        out.append(e)
    return out


def test_capacity_admissions_are_redriven_from_the_drained_instances_each_logged():
    """Two episodes a batch, K = 1, two spares, version 0 (batches 1 and 2 may train what is
    admitted): four fit the bound; a fifth beside one drained instance may count on a spare;
    a sixth logged with no instance drained is one the rules would have held back."""
    overrides = ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.in_flight=keep",
                 "pipeline.admission=capacity", "pipeline.partial_rollout=2", "pipeline.queries_per_step=2",
                 "run.steps=4", "agents.a.model='m'"]
    cfg = load_config(None, overrides, defaults={})
    admitted = [ev.EpisodeAdmitted(f"s{b}q{i}", b, 2, 0) for b in (1, 2) for i in (0, 1)]
    events = [ev.RunStarted(dump_toml(cfg), ["a"], "async", 1, 0), *admitted,
              ev.EpisodeAdmitted("s1p0", 1, 2, 1), ev.EpisodeAssigned("s1q0", 1, 1),
              ev.EpisodeAdmitted("s3q0", 3, 2, 0)]
    for seq, e in enumerate(events):
        e.seq, e.t = seq, float(seq)
    made = [msgspec.structs.replace(e, seq=-1, t=0.0) for e in redrive.episode_assignments(events)]
    logged = [msgspec.structs.replace(e, seq=-1, t=0.0) for e in events[1:]]
    assert made[:-1] == logged[:-1]  # within the bound, and the spare beside a drained instance
    assert made[-1] == ev.EpisodeAdmitted("s3q0", 3, -1, 0)  # 5 running + 1 ended: no spare without a drained one
    assert "EpisodeAdmitted" in (replay.check(events) or "")
    events[-1].drained = 1  # one drained instance: the spare over already is its one
    assert "EpisodeAdmitted" in (replay.check(events) or "")
    events[-1].drained = 2
    assert replay.check(events) is None


def test_an_abandoned_episode_is_redriven_only_once_the_batches_its_bound_allows_are_full():
    """Two episodes a batch, K = 1, one spare, version 0: five admitted for batches 1 and 2.
    The fifth is abandoned once four have ended into them; one abandoned a turn earlier (a
    batch its bound allows still had room), or a first turn admitted into the full bound,
    is a decision the rules would not make."""
    overrides = ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.in_flight=keep",
                 "pipeline.admission=continuous", "pipeline.partial_rollout=1", "pipeline.queries_per_step=2",
                 "run.steps=4", "agents.a.model='m'"]
    cfg = load_config(None, overrides, defaults={})
    names = ["s1q0", "s1q1", "s2q0", "s2q1", "s1p0"]
    ended = [ev.EpisodeAssigned(name, int(name[1]), batch) for name, batch in zip(names, (1, 1, 2, 2))]
    events = [ev.RunStarted(dump_toml(cfg), ["a"], "async", 1, 0),
              *[ev.EpisodeAdmitted(name, int(name[1]), 2) for name in names], *ended,
              ev.EpisodeAbandoned("s1p0", 1, 2)]
    for seq, e in enumerate(events):
        e.seq, e.t = seq, float(seq)
    made = [msgspec.structs.replace(e, seq=-1, t=0.0) for e in redrive.episode_assignments(events)]
    assert made == [msgspec.structs.replace(e, seq=-1, t=0.0) for e in events[1:]]
    assert replay.check(events) is None
    early = events[:-2] + [events[-1], events[-2]]  # abandoned before batch 2 was full
    assert "EpisodeAbandoned" in (replay.check(early) or "")
    late = events + [ev.EpisodeAdmitted("s1p1", 1, 2, seq=99, t=99.0)]  # into batches 1 and 2, full
    assert "EpisodeAdmitted" in (replay.check(late) or "")
