"""Faults in a tool, a reward or model-written code, in real runs (`flexmarl run` as a
process: controller, rollout, trainer and environment workers): the run goes on, only the
episodes whose call failed fail, each with one line naming the episode and the function,
and nothing is lost or trained twice (`flexmarl replay --check`).

On the environment worker's processes: a function that segfaults, one that allocates
until its process's memory limit, one that never returns. In the sandbox, run by a
function there: a program that forks without end, one that writes outside its
directory, one that opens a socket. And the environment worker itself killed mid-run: it
is restarted like any worker, the call it held fails its episode alone (slow)."""

import argparse
import json
import os
import re
import signal
import socket
import threading

import pytest

from flexmarl.controller import replay
from flexmarl.controller.testing import faults as fm

JOB = '''
[run]
workflow = "flow.py:episode"
steps = STEPS
checkpoint_every = 0

[cluster]
rollout_workers = 1
trainer_workers = 1
env_workers = 1
restart_backoff_s = 0.5

[env]
processes = 2
process_memory_mb = 512

[pipeline]
mode = "async"
max_staleness = 1
queries_per_step = 4
micro_batch = 8
tool_timeout_s = 4.0

[data]
train = "train.jsonl"
shuffle = false

[agents.writer]
model = "tiny:planner"
group_size = 4
max_tokens = 4
'''

FLOW = '''
import os, time
from flexmarl.runtime.sandbox import Limits, run_python

def ok(text):
    return float(len(set(text.split())))

def segfault(text):
    os.kill(os.getpid(), 11)

def allocate(text):
    chunks = []
    while True:
        chunks.append(bytearray(10 ** 8))

def never_returns(text):
    while True:
        time.sleep(1)

def forks(text):
    return run_python("import os\\nwhile True:\\n    os.fork()", limits=Limits(processes=4, wall_s=10)).check().exit_status

def writes_outside(text):
    target = os.environ["FAULT_TARGET"]
    return run_python(f"open({target!r}, 'w').write('escaped')").check().exit_status

def opens_a_socket(text):
    port = os.environ["FAULT_PORT"]
    return run_python(f"import socket\\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)").check().exit_status

def sleeps(text):
    open(os.environ["FAULT_MARK"], "w").close()  # the test kills the worker once this call runs
    time.sleep(float(os.environ.get("FAULT_SLEEP", "0")))
    return 1.0

async def episode(ctx):
    samples = await ctx.generate("writer", ctx.item["prompt"])
    await ctx.call(globals()[ctx.item["fault"]], samples[0].text)
    for s in samples:
        ctx.reward(s, await ctx.call(ok, s.text))
'''

FAULT_LINE = re.compile(r"episode (s\d+q\d+) failed: (.*); dropping its unfinished groups")


def write_job(folder, faults, fault_every=4):
    """A step per fault: the first episode of step k runs fault k, the others `ok`."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for fault in faults:
        rows += [{"prompt": "3 1 2", "fault": fault}] + [{"prompt": "2 1 3", "fault": "ok"}] * (fault_every - 1)
    (folder / "job.toml").write_text(JOB.replace("STEPS", str(len(faults))))
    (folder / "flow.py").write_text(FLOW)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "job.toml"


class Listener:
    """A socket the sandboxed program tries to reach; records whoever connects."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.accepted, self.stopped = [], False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def port(self):
        return self.sock.getsockname()[1]

    def _accept(self):
        while not self.stopped:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self):
        self.stopped = True
        self.thread.join()
        self.sock.close()


def failed_episodes(stderr):
    """Episode id -> its one failure line."""
    found = {}
    for line in stderr.splitlines():
        if match := FAULT_LINE.search(line):
            found[match.group(1)] = match.group(2)
    return found


def replay_checks(run_dir):
    args = argparse.Namespace(log=str(run_dir / "events.log"), trace=None, plot=None, check=True)
    return replay.main(args)


def run_faults(tmp_path, faults, extra_env=None, timeout=900):
    job = write_job(tmp_path / "job", faults)
    run_dir = tmp_path / "run"
    controller = fm.start(job, run_dir, tmp_path / fm.STDERR, extra_env=extra_env)
    code = controller.wait(timeout)
    return code, controller.stderr(), run_dir


def assert_only_those_failed(stderr, run_dir, expected):
    """`expected`: episode -> a pattern its one line must match; every other episode succeeded."""
    failed = failed_episodes(stderr)
    assert set(failed) == set(expected), stderr[-4000:]
    for episode, pattern in expected.items():
        assert re.search(pattern, failed[episode]), (episode, failed[episode])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["episodes_failed"] for m in metrics if m.get("kind", "train") == "train") == len(expected)
    assert replay_checks(run_dir) == 0


def test_a_segfault_in_a_tool_and_a_fork_storm_in_the_sandbox_fail_their_episodes_alone(tmp_path):
    code, stderr, run_dir = run_faults(tmp_path, ["segfault", "forks"])
    assert code == 0, stderr[-4000:]
    assert_only_those_failed(stderr, run_dir, {
        "s1q0": r"EnvCallFailed: flow.py:segfault failed on env-0: the process running segfault died under it "
                r"\(killed by SIGSEGV\)",
        "s2q0": r"EnvCallFailed: flow.py:forks failed on env-0: SandboxError: the sandboxed program hit its "
                r"processes limit"})


@pytest.mark.slow
def test_every_fault_of_a_tool_or_of_model_written_code_costs_its_episode_alone(tmp_path):
    target = tmp_path / "outside" / "escaped.txt"
    target.parent.mkdir()
    listener = Listener()
    try:
        code, stderr, run_dir = run_faults(
            tmp_path, ["segfault", "allocate", "never_returns", "forks", "writes_outside", "opens_a_socket"],
            extra_env={"FAULT_TARGET": str(target), "FAULT_PORT": str(listener.port)})
    finally:
        listener.close()
    assert code == 0, stderr[-4000:]
    assert_only_those_failed(stderr, run_dir, {
        "s1q0": r"flow.py:segfault failed on env-0: .*killed by SIGSEGV",
        "s2q0": r"flow.py:allocate failed on env-0: MemoryError",
        "s3q0": r"TimeoutError: flow.py:never_returns did not return within 4.0s",
        "s4q0": r"flow.py:forks failed on env-0: SandboxError: .* hit its processes limit",
        "s5q0": r"flow.py:writes_outside failed on env-0: SandboxError: .*PermissionError",
        "s6q0": r"flow.py:opens_a_socket failed on env-0: SandboxError: .*(Network is unreachable|refuses)"})
    assert not target.exists() and listener.accepted == []
    for line in failed_episodes(stderr).values():
        assert "\n" not in line


@pytest.mark.slow
def test_an_environment_worker_killed_mid_run_is_restarted_and_fails_only_the_calls_it_held(tmp_path):
    """Calls asked for while the only worker is on its way back wait for it (a time limit
    long enough: 90 s); the ones it held when killed fail their episodes, one line each.
    Which calls it holds depends on timing: under max_staleness 1 the next step's episodes
    may all be waiting on it too, so neither failed episodes nor an empty step stop the run."""
    job = write_job(tmp_path / "job", ["sleeps"] + ["ok"] * 5)
    run_dir = tmp_path / "run"
    mark = tmp_path / "sleeping"
    controller = fm.start(job, run_dir, tmp_path / fm.STDERR, "--set", "pipeline.tool_timeout_s=90",
                          "--set", "pipeline.max_failed_share=1.0", "--set", "pipeline.allow_empty_steps=true",
                          extra_env={"FAULT_SLEEP": "60", "FAULT_MARK": str(mark)})
    try:
        fm.wait_for(mark.exists, controller, what="the first episode's call began")
        fm.signal_pid(fm.workers(run_dir)["env-0"], signal.SIGKILL)
        code = controller.wait(900)
    finally:
        if controller.proc.poll() is None:
            controller.proc.kill()
    stderr = controller.stderr()
    assert code == 0, stderr[-4000:]
    assert re.search(r"worker env-0 its process \(pid \d+\) exited with code -9; starting it again", stderr)
    assert "environment worker env-0 is back" in stderr
    failed = failed_episodes(stderr)
    assert "s1q0" in failed and all(re.match(r"EnvWorkerLost: flow.py:(sleeps|ok): worker env-0 is gone: its "
                                             r"process \(pid \d+\) exited with code -9", line)
                                    for line in failed.values()), failed
    assert replay_checks(run_dir) == 0
