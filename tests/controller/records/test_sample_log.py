"""Sample texts: a few trained samples per agent per step, each turn with its policy
version, best and worst reward first; printed by step and agent."""

import json
from types import SimpleNamespace

import pytest

from flexmarl.controller.records.sample_log import SampleLog, format_samples, read_samples
from flexmarl.runtime.keys import GroupKey


class WordTokenizer:
    words = {1: "sort", 2: "3", 3: "1", 4: "2", 5: "A reviewer says:", 6: "wrong"}

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


def sample(sid, reward, batch=1, **kw):
    group, _, member = sid.rpartition("/")
    fields = dict(sample_id=sid, key=GroupKey("e", "a", group), member=int(member), batch=batch, prompt_ids=[1, 2, 3],
                  output_ids=[4], mask=[1], versions=[0], reward=reward, messages=None)
    fields.update(kw)
    fields.setdefault("token_versions", [fields["versions"][0]] * len(fields["output_ids"]))
    return SimpleNamespace(**fields)


def test_each_step_writes_the_best_the_worst_and_samples_between_with_every_turn_and_version(tmp_path):
    log = SampleLog(tmp_path, 3, {"a": WordTokenizer()})
    samples = [sample(f"g/{i}", float(i)) for i in range(5)]
    samples[4] = sample("g/4", 4.0, output_ids=[4, 5, 6, 2], mask=[1, 0, 0, 1], versions=[0, 1],
                        token_versions=[0, 1, 1, 1])
    log.group_ready("a", "g", samples)
    rows = log.record(1, "a", ["g"])
    assert [r["reward"] for r in rows] == [4.0, 0.0, 2.0]
    assert [(r["sample_id"], r["group"], r["member"]) for r in rows] == [  # its name, and which sample it is
        ("g/4", ["e", "a", "g"], 4), ("g/0", ["e", "a", "g"], 0), ("g/2", ["e", "a", "g"], 2)]
    assert rows[0]["turns"] == [{"role": "prompt", "text": "sort 3 1"}, {"role": "agent", "text": "2", "version": 0},
                                {"role": "appended", "text": "A reviewer says: wrong"},
                                {"role": "agent", "text": "3", "version": 1}]
    assert read_samples(tmp_path) == rows
    assert log.record(1, "a", ["g"]) == []  # a step's snapshots go once it is recorded


def test_a_turn_whose_weights_changed_under_it_shows_which_tokens_each_version_made(tmp_path):
    log = SampleLog(tmp_path, 1, {"a": WordTokenizer()})
    log.group_ready("a", "g", [sample("g/0", 1.0, output_ids=[4, 2, 3, 4], versions=[3],
                                      token_versions=[3, 3, 4, 4])])
    (row,) = log.record(1, "a", ["g"])
    assert row["versions"] == [3] and row["token_versions"] == [[3, 2], [4, 2]]
    assert "  tokens by version: v3 x2, v4 x2" in format_samples(read_samples(tmp_path)).splitlines()
    log.group_ready("a", "h", [sample("h/0", 1.0, output_ids=[4, 2], versions=[3])])
    assert "token_versions" not in log.record(2, "a", ["h"])[0]  # one version throughout: nothing more said


def test_a_conversation_is_shown_by_its_messages_with_the_version_of_each_reply(tmp_path):
    log = SampleLog(tmp_path, 1, {})
    messages = [{"role": "user", "content": "What is 7 + 5?"}, {"role": "assistant", "content": "13"},
                {"role": "user", "content": "It is 12, wrong."}, {"role": "assistant", "content": "12"}]
    log.group_ready("solver", "c", [sample("c/0", 0.75, messages=messages, versions=[2, 3])])
    (row,) = log.record(3, "solver", ["c"])
    assert [t.get("version") for t in row["turns"]] == [None, 2, None, 3]
    text = format_samples(read_samples(tmp_path))
    assert text.splitlines()[:4] == ["=== step 3  agent solver  (1 samples, reward 0.750 best, 0.750 worst)",
                                     "--- c/0  reward 0.750 best  versions [2, 3]",
                                     "  user: What is 7 + 5?", "  assistant (v2): 13"]


def test_samples_are_printed_by_step_then_agent_and_can_be_filtered(tmp_path):
    rows = [{"step": s, "agent": a, "sample_id": f"{a}{s}", "reward": 1.0, "versions": [0],
             "turns": [{"role": "prompt", "text": "x"}]} for s in (2, 1) for a in ("b", "a")]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    heads = [line for line in format_samples(read_samples(tmp_path)).splitlines() if line.startswith("===")]
    assert [h.split("(")[0] for h in heads] == ["=== step 1  agent a  ", "=== step 1  agent b  ",
                                                "=== step 2  agent a  ", "=== step 2  agent b  "]
    assert format_samples(read_samples(tmp_path), step=2, agent="b").count("===") == 1


def test_a_resumed_run_keeps_the_samples_up_to_its_checkpoint_and_writes_the_rest_again(tmp_path):
    rows = [{"step": s, "agent": "a", "sample_id": f"g{s}", "reward": 1.0, "versions": [0], "turns": []}
            for s in (1, 2, 3)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "ag')
    SampleLog(tmp_path, 1, {}, resumed_after=2)
    assert [r["step"] for r in read_samples(tmp_path)] == [1, 2]


def test_flexmarl_samples_for_a_step_or_agent_the_run_never_recorded_exits_non_zero_saying_what_it_has(
        tmp_path, capsys):
    from flexmarl.controller import cli

    rows = [{"step": s, "agent": a, "sample_id": f"{a}{s}", "reward": 1.0, "versions": [0],
             "turns": [{"role": "prompt", "text": "x"}]} for s in (1, 2, 3) for a in ("writer", "critic")]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for flags, line in ((["--step", "999"], "no samples of step 999: the run recorded steps 1 to 3"),
                        (["--agent", "nobody"], "no samples of agent 'nobody': the run recorded critic, writer")):
        with pytest.raises(SystemExit) as exit:
            cli.main(["samples", str(tmp_path), *flags])
        assert exit.value.code == f"flexmarl: {tmp_path}: {line}"  # printed to stderr, exit status 1
        assert capsys.readouterr().out == ""
    cli.main(["samples", str(tmp_path), "--step", "2", "--agent", "critic"])
    assert capsys.readouterr().out.count("===") == 1


def test_a_frozen_agents_served_samples_are_written_once_their_step_ends_marked_not_trained(tmp_path):
    log = SampleLog(tmp_path, 2, {"judge": WordTokenizer()})
    log.group_served("judge", [sample("j/0", None), sample("j/1", 1.0), sample("k/0", 0.5, batch=2)])
    rows = log.record_served(1)
    assert [(r["sample_id"], r["reward"], r["trained"]) for r in rows] == [("j/1", 1.0, False), ("j/0", None, False)]
    assert log.record_served(1) == []  # each once
    text = format_samples(read_samples(tmp_path))
    assert "reward none" in text and "(served: generated, not trained)" in text
    assert [r["sample_id"] for r in log.record_served(2)] == ["k/0"]
