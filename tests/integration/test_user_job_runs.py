"""A user's own small job run as a user runs it, `flexmarl run` in a process of its own:
a workflow that always fails stops the run with the user's file and line; workers die with
their controller, however it dies; a run resumes from another directory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

JOB = '''
[run]
workflow = "flow.py:episode"
steps = 2

[cluster]
rollout_workers = 1
trainer_workers = 1

[pipeline]
queries_per_step = 2

[data]
train = "train.jsonl"

[agents.writer]
model = "tiny:planner"
group_size = 2
max_tokens = 2
'''

WORKS = '''
async def episode(ctx):
    samples = await ctx.generate("writer", ctx.item["prompt"])
    for s in samples:
        ctx.reward(s, float(len(s.text)))
'''

TYPO = '''
async def episode(ctx):
    samples = await ctx.generate("writer", ctx.item["prompt"].text)
    for s in samples:
        ctx.reward(s, 1.0)
'''


def write_job(folder: Path, flow: str = WORKS, job: str = JOB) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.toml").write_text(job)
    (folder / "flow.py").write_text(flow)
    (folder / "train.jsonl").write_text('{"prompt": "3 1 2"}\n{"prompt": "2 1 3"}\n')
    return folder / "job.toml"


def flexmarl(*args, cwd=ROOT, env=None):
    # The tiny models are cached once per machine (or in FLEXMARL_MODEL_CACHE), whatever the working directory.
    env = env or dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_workflow_that_always_fails_stops_the_run_with_the_users_file_and_line(tmp_path):
    config = write_job(tmp_path / "job", TYPO)
    proc = flexmarl("run", str(config), "--out", str(tmp_path / "run"), "--no-progress")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-3000:]
    flow = tmp_path / "job" / "flow.py"
    # Every failed episode's log line, and the error that ends the run, name the user's frame.
    assert f"episode s1q0 failed: AttributeError: 'str' object has no attribute 'text' (at {flow}:3 in episode)" \
        in err
    assert "flexmarl: the run cannot learn: 2 of the 2 episodes of step 1 failed" in err
    assert f'File "{flow}", line 3, in episode' in err and 'samples = await ctx.generate("writer", ' \
        'ctx.item["prompt"].text)' in err
    assert "steps in" not in out  # no summary of a finished run
    assert not (tmp_path / "run" / "checkpoints" / "final").exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_workers_die_with_their_controller_when_it_is_killed(tmp_path):
    config = write_job(tmp_path / "job", job=JOB.replace("steps = 2", "steps = 200"))
    run_dir = tmp_path / "run"
    proc = flexmarl("run", str(config), "--out", str(run_dir), "--no-progress")
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while len(pids) < 2:  # both workers started (the launcher logs each one's PID)
            assert proc.poll() is None and time.monotonic() < deadline
            line = proc.stderr.readline()
            if "started " in line and " worker " in line and "(pid " in line:
                pids.append(int(line.rsplit("(pid ", 1)[1].split(")")[0]))
        while "runs writer's engine" not in proc.stderr.readline():  # its engine is up: a worker at work
            assert proc.poll() is None and time.monotonic() < deadline
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone_by = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)], "workers outlived their controller"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


CHAT_JOB = '''
[run]
workflow = "flow.py:episode"
steps = 1

[cluster]
rollout_workers = 1
trainer_workers = 1

[pipeline]
queries_per_step = 2

[data]
train = "train.jsonl"

[agents.critic]
model = "MODEL"
group_size = 2
max_tokens = 4
'''

CHAT = '''
async def episode(ctx):
    replies = await ctx.chat("critic", [{"role": "user", "content": "Question: What is 2 + 3? Answer: 5"}])
    for r in replies:
        ctx.reward(r, float("correct" in r.text))
'''


def test_a_checkpoint_of_a_chat_job_is_a_model_a_chat_job_can_use(tmp_path):
    """The checkpoint carries the tokenizer's files, chat template included: transformers
    applies its template and a job naming it as a model chats with it."""
    from transformers import AutoTokenizer

    verifier = f"tiny:{ROOT}/examples/review_chain/models.py:verifier"
    first = write_job(tmp_path / "first", CHAT, CHAT_JOB.replace("MODEL", verifier))
    proc = flexmarl("run", str(first), "--out", str(tmp_path / "run1"), "--no-progress")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    checkpoint = tmp_path / "run1" / "checkpoints" / "final" / "critic"
    assert (checkpoint / "chat_template.jinja").is_file()
    # two episodes x one group of 2 samples: every sample's prompt, and what vLLM found cached of it
    (row,) = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    assert row["prompt_tokens"] > 0 and row["prompt_tokens"] % 4 == 0 and 0 <= row["prefix_hit_rate"] <= 1
    assert row["turn_prefix_hit_rate"] is None  # no later turns
    prompt = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [{"role": "user", "content": "Question: What is 2 + 3? Answer: 5"}], tokenize=False, add_generation_prompt=True)
    assert "What is 2 + 3?" in prompt

    second = write_job(tmp_path / "second", CHAT, CHAT_JOB.replace("MODEL", str(checkpoint)))
    proc = flexmarl("run", str(second), "--out", str(tmp_path / "run2"), "--no-progress")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "0 failed episodes" in out


def test_a_job_started_in_one_directory_resumes_from_another_and_its_samples_read_as_text(tmp_path):
    """Relative paths in the TOML are the TOML's: the run directory keeps them absolute, so
    `--resume` works from anywhere. The build of a model shows its progress, and
    `flexmarl samples` prints what the agents said, step by step."""
    write_job(tmp_path / "me" / "job")
    cache = {"FLEXMARL_MODEL_CACHE": str(tmp_path / "models")}  # empty: the model is built, with progress
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", **cache)
    proc = flexmarl("run", "job/job.toml", "--steps", "1", "--out", "../run", "--no-progress",
                    "--set", "run.samples_per_step=2", cwd=tmp_path / "me", env=env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"building model tiny:planner for agent writer (once per machine, cached in {tmp_path / 'models'}): done in" in err
    assert "starting 1 rollout engines and 1 training states: done in" in err
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert f'workflow = "{tmp_path}/me/job/flow.py:episode"' in saved
    assert f'train = "{tmp_path}/me/job/train.jsonl"' in saved

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = flexmarl("run", "--resume", "../run", "--steps", "2", "--no-progress", cwd=elsewhere, env=env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "resuming" in err and (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()

    proc = flexmarl("samples", str(tmp_path / "run"), env=env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "=== step 1  agent writer  (2 samples" in out and "=== step 2  agent writer  (2 samples" in out
    assert "  prompt: 3 1 2" in out or "  prompt: 2 1 3" in out
    assert "  agent (v0): " in out and "  agent (v1): " in out


def test_micro_batches_cut_by_a_token_budget_train_whole_groups_and_replay_checks_them(tmp_path):
    """`pipeline.micro_batch_tokens`: a group here is its prompt plus two outputs of 1-2
    tokens, 5 to 8 tokens in all, so a budget of 8 takes one group per micro-batch; the
    re-drive of `flexmarl replay --check` cuts the same ones from the logged token counts."""
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.eventlog import read_events

    job = write_job(tmp_path / "job")
    proc = flexmarl("run", str(job), "--out", str(tmp_path / "run"), "--no-progress",
                    "--set", "pipeline.micro_batch_tokens=8")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    events, problem = read_events(tmp_path / "run" / "events.log")
    assert problem is None
    tokens = {e.key: e.tokens for e in events if isinstance(e, ev.GroupComplete)}
    assert tokens and all(5 <= n <= 8 for n in tokens.values())  # two never fit in 8
    formed = [e for e in events if isinstance(e, ev.MicroBatchFormed)]
    assert len(formed) == 2 * 2  # 2 steps of 2 groups, one group each
    assert all(len(e.parts.keys) == 1 and e.parts.count == 2 for e in formed)
    proc = flexmarl("replay", str(tmp_path / "run" / "events.log"), "--check")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
