"""Mistakes in what a user wrote (workflow, data, models) are one line on stderr naming the
file, `flexmarl run` exits non-zero before any worker starts, and no run directory is
left behind; `--debug` adds the traceback."""

import pytest

from flexmarl.controller import cli

JOB = '''
[run]
workflow = "flow.py:episode"
steps = 1

[cluster]
rollout_workers = 1

[data]
train = "train.jsonl"

[agents.writer]
model = "tiny:planner"
group_size = 2
'''


def run(tmp_path, capsys, *extra, job=JOB, flow="async def episode(ctx):\n    pass\n",
        rows='{"question": "1 2 3"}\n'):
    (tmp_path / "job.toml").write_text(job)
    (tmp_path / "flow.py").write_text(flow)
    (tmp_path / "train.jsonl").write_text(rows)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", str(tmp_path / "job.toml"), "--out", str(out), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code != 0
    assert not out.exists(), "a failed start left its run directory"
    return [line for line in err.splitlines() if line.startswith("flexmarl:")], err


@pytest.mark.parametrize(("typo", "line"), [
    (("flow.py:", "flwo.py:"), "flexmarl: run.workflow = 'TMP/flwo.py:episode': no file TMP/flwo.py"),
    (('"train.jsonl"', '"trian.jsonl"'), "flexmarl: data.train: dataset 'TMP/trian.jsonl' does not exist"),
], ids=["workflow-file", "data-file"])
def test_a_missing_file_of_the_job_is_one_line_naming_the_key_and_the_file(tmp_path, capsys, typo, line):
    lines, err = run(tmp_path, capsys, job=JOB.replace(*typo))
    assert lines == [line.replace("TMP", str(tmp_path))]
    assert "Traceback" not in err


@pytest.mark.parametrize(("flow", "named"), [
    ("async def episdoe(ctx):\n    pass\n", "TMP/flow.py has no 'episode' (its async functions: episdoe)"),
    ("import json\nCONFIG = json.loads('{')\n", "(at TMP/flow.py:2 in <module>)"),
], ids=["missing-function-names-what-it-defines", "raising-on-import-names-its-line"])
def test_a_workflow_file_that_does_not_give_the_workflow_is_one_line_naming_the_file(tmp_path, capsys, flow, named):
    lines, _ = run(tmp_path, capsys, flow=flow)
    assert len(lines) == 1 and named.replace("TMP", str(tmp_path)) in lines[0]


def test_a_malformed_jsonl_names_the_row_and_the_reason(tmp_path, capsys):
    lines, _ = run(tmp_path, capsys, rows='{"question": "1 2 3"}\n{"question": "4 5"\n')
    assert lines == [f"flexmarl: data.train: {tmp_path}/train.jsonl line 2 is not valid JSON: "
                     "Expecting ',' delimiter at column 19"]
    lines, _ = run(tmp_path, capsys, rows='["1 2 3"]\n')
    assert len(lines) == 1 and "train.jsonl line 1 is a JSON list, not an object" in lines[0]


def test_an_unknown_model_is_one_line_before_any_worker_starts(tmp_path, capsys):
    lines, err = run(tmp_path, capsys, job=JOB.replace("tiny:planner", "tiny:plannr"))
    assert lines == ["flexmarl: unknown built-in model 'tiny:plannr' (built in: tiny:planner, tiny:solver, "
                     "tiny:checker)"]
    assert "started rollout worker" not in err


def test_debug_shows_the_traceback(tmp_path, capsys):
    lines, err = run(tmp_path, capsys, "--debug", job=JOB.replace("flow.py:", "flwo.py:"))
    assert "Traceback (most recent call last)" in err and "WorkflowError" in err
    assert lines[-1].startswith("flexmarl: run.workflow =")
