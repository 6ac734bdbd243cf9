"""Faults injected into real runs: the job, the injections and the judging shared by the
fault tests (tests/integration/test_faults.py) and the fault bench
(bench/faults/fault_matrix.py, whose docstring lists the faults and what is measured).

Every run is a real `flexmarl run` of one small job (a tiny model, one rollout worker,
one trainer, async K = 1, a checkpoint every step) started as a process; nothing here
imports the controller's running code (the judging reads the event log through
`flexmarl replay`'s code).
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# The checkout (an editable install): where the tiny models are cached and runs start.
ROOT = Path(__file__).resolve().parents[2]

JOB = '''
[run]
workflow = "flow.py:episode"
steps = STEPS
checkpoint_every = 1
keep_checkpoints = 3

[cluster]
rollout_workers = 1
trainer_workers = 1
restart_backoff_s = 0.5

[transport]
heartbeat_timeout_s = 5.0

[pipeline]
mode = "async"
max_staleness = 1
queries_per_step = 4
micro_batch = 8

[data]
train = "train.jsonl"

[agents.writer]
model = "tiny:planner"
group_size = 4
max_tokens = 4
'''

# The workflow raises from step FAIL_FROM on (never when it is 0): the workflow-error fault.
# Each episode first waits FAULT_SLEEP_S (an environment's latency: the pipeline idles,
# waiting for samples, most of the time) and, with FAULT_KEY_FILE, writes its OpenAI API
# key there (the large-request fault posts with it).
FLOW = '''
import asyncio
import os

FAIL_FROM = int(os.environ.get("FAULT_FAIL_FROM", "0"))
SLEEP_S = float(os.environ.get("FAULT_SLEEP_S", "0"))
KEY_FILE = os.environ.get("FAULT_KEY_FILE", "")


async def episode(ctx):
    if FAIL_FROM and ctx.batch >= FAIL_FROM:
        raise RuntimeError(f"the workflow fails from step {FAIL_FROM} on")
    if KEY_FILE:
        with open(KEY_FILE, "a") as f:
            f.write(ctx.openai_api_key + "\\n")
    await asyncio.sleep(SLEEP_S)
    samples = await ctx.generate("writer", ctx.item["prompt"])
    for s in samples:
        ctx.reward(s, float(len(set(s.text.split()))))
'''

ROWS = ["3 1 2", "2 1 3", "1 3 2", "3 2 1"]
STDERR = "controller.stderr"  # every controller process of a run, beside its run directory


def write_job(folder: Path, steps: int = 30, field_name: str = "prompt") -> Path:
    """The job in `folder`; `field_name` is what the data rows call the prompt."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.toml").write_text(JOB.replace("STEPS", str(steps)))
    (folder / "flow.py").write_text(FLOW)
    (folder / "train.jsonl").write_text("".join(f'{{"{field_name}": "{row}"}}\n' for row in ROWS))
    return folder / "job.toml"


def env(**extra: str) -> dict[str, str]:
    # The tiny models are cached once per machine (or in FLEXMARL_MODEL_CACHE), whatever the working directory.
    return dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", **extra)


class Controller:
    """One `flexmarl run` process; its stderr is appended to a file (never on the run's disk)."""

    def __init__(self, args: list[str], stderr: Path, extra_env: dict[str, str] | None = None) -> None:
        self.stderr_path = stderr
        self._fh = open(stderr, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", "run", "--no-progress", *args],
                                     env=env(**(extra_env or {})), stdout=subprocess.DEVNULL, stderr=self._fh,
                                     cwd=ROOT)

    def wait(self, timeout: float = 900) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._fh.close()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def start(job: Path, run_dir: Path, stderr: Path, *flags: str, extra_env: dict[str, str] | None = None) -> Controller:
    return Controller([str(job), "--out", str(run_dir), *flags], stderr, extra_env)


def resume(run_dir: Path, stderr: Path, *flags: str) -> Controller:
    return Controller(["--resume", str(run_dir), *flags], stderr)


def events(run_dir: Path) -> list:
    from flexmarl.runtime.eventlog import read_events

    try:
        return read_events(run_dir / "events.log")[0]
    except (FileNotFoundError, OSError):
        return []


def workers(run_dir: Path) -> dict[str, int]:
    """Worker id -> pid of its latest registration."""
    from flexmarl.runtime import events as ev

    return {e.worker: e.pid for e in events(run_dir) if isinstance(e, ev.WorkerJoined)}


def wait_for(condition, controller: Controller, timeout: float = 900, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if controller.proc.poll() is not None:
            raise RuntimeError(f"the run ended (code {controller.proc.returncode}) before {what}:\n"
                               f"{controller.stderr()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(0.2)


def last_step(run_dir: Path) -> int:
    from flexmarl.runtime import events as ev

    return max((e.version for e in events(run_dir) if isinstance(e, ev.OptimizerStep)), default=0)


def training_began(run_dir: Path) -> bool:
    from flexmarl.runtime import events as ev

    return any(isinstance(e, ev.BatchStarted) for e in events(run_dir))


def checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints renamed into place (complete), newest first."""
    found = [p for p in (run_dir / "checkpoints").glob("step-*") if p.is_dir() and not p.is_symlink()]
    return sorted(found, reverse=True)


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def interrupt(proc: subprocess.Popen, timeout: float) -> None:
    """Stops a `flexmarl` process as Ctrl-C does (a normal stop); kills it if it has not
    exited within `timeout` seconds."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def rss_mib(pid: int) -> float | None:
    """The process's resident memory (VmRSS) in MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024
    except (FileNotFoundError, StopIteration, ProcessLookupError):
        return None


def stop_orphans(pids: dict[str, int]) -> None:
    """A killed controller's workers exit on their own within seconds; whatever is left of
    exactly those processes is stopped by pid, as an operator would before resuming."""
    for pid in pids.values():
        signal_pid(pid, signal.SIGKILL)


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x01]))


@dataclass
class Outcome:
    fault: str
    at: str = ""  # when it was injected: seconds into training, or the step the workflow fails from
    codes: list[int] = field(default_factory=list)  # exit code of each controller process
    finished: bool = False
    lost: int = 0
    twice: int = 0
    check: str = ""
    tracebacks: int = 0
    last_line: str = ""
    stderr: str = ""
    resumed_from: list[int] = field(default_factory=list)  # the checkpoints each resume started from
    shm_left: int = 0  # shared-memory files and directories of the run's worker processes still there
    left_out: list[int] = field(default_factory=list)  # batches damage to the event log split (replay leaves them out)

    def row(self) -> list[str]:
        return [self.fault, self.at, "finished" if self.finished else "stopped",
                "/".join(map(str, self.codes)), ", ".join(map(str, self.resumed_from)) or "-", str(self.lost),
                str(self.twice), self.check, str(self.tracebacks), str(self.shm_left),
                ", ".join(map(str, self.left_out)) or "-", self.last_line]


UNEXPECTED = ("Traceback (most recent call last)", "never retrieved", "InvalidStateError")


def judge(outcome: Outcome, run_dir: Path, steps: int) -> Outcome:
    """Fills what the event log and stderr say about the run."""
    from flexmarl.controller import replay
    from flexmarl.runtime import events as ev

    logged = events(run_dir)
    counted = replay.lineage(logged)
    stepped = {(e.agent, e.version) for e in counted if isinstance(e, ev.OptimizerStep)}
    formed = collections.Counter(s for e in counted if isinstance(e, ev.MicroBatchFormed)
                                 and (e.agent, e.version) in stepped for s in e.parts.samples())
    outcome.twice = sum(1 for n in formed.values() if n > 1)
    summary = replay.summarize(logged)
    totals = [r for r in summary.accounting if r.total]
    outcome.lost = sum(max(0, r.generated - r.trained - r.dropped - r.in_flight) for r in totals)
    outcome.left_out = sorted(replay.lost_batches(counted))  # stepped, but the log lost what of them
    outcome.finished = ({v for _, v in stepped} | set(outcome.left_out)) >= set(range(1, steps + 1)) and (
        run_dir / "checkpoints" / "final").exists()
    outcome.check = "ok" if logged and replay.check(logged) is None else "FAILED" if logged else "-"
    text = (run_dir.parent / STDERR).read_text(errors="replace")
    outcome.tracebacks = sum(text.count(marker) for marker in UNEXPECTED)
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    outcome.last_line = lines[-1][:160] if lines and outcome.codes[0] > 0 else "-"  # killed: it said nothing
    outcome.resumed_from = [e.step for e in logged if isinstance(e, ev.RunResumed)]
    outcome.shm_left = len(shm_left([e.pid for e in logged if isinstance(e, ev.WorkerJoined)]))
    return outcome


def shm_left(pids: list[int]) -> list[str]:
    """What processes `pids` created in shared memory (parameter segments, an engine's
    adapter and cancellation directories) and is still there."""
    names = tuple(f"flexmarl-{kind}-{pid}-" for pid in pids for kind in ("param", "lora", "cancel"))
    return [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(names)]


# ---------------------------------------------------------------- the faults


def run_with(fault: str, work: Path, rng: random.Random, steps: int = 30) -> Outcome:
    """One run of the job with `fault` injected; returns its outcome."""
    job = write_job(work / "job", steps, "question" if fault == "missing-field" else "prompt")
    run_dir = work / "run"
    outcome = Outcome(fault)
    flags, extra = JOB_SETTINGS.get(fault, ((), {}))
    extra = {k: v.replace("WORK", str(work)) for k, v in extra.items()}
    if fault == "workflow-error":
        extra["FAULT_FAIL_FROM"] = str(rng.randint(2, steps - 1))
        outcome.at = f"step {extra['FAULT_FAIL_FROM']}"
    mount = work / "disk" if fault == "disk-full" else None
    if mount is not None:
        mount.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
        run_dir = mount / "run"
    try:
        controller = start(job, run_dir, work / STDERR, *flags, extra_env=extra)
        if fault not in ("missing-field", "workflow-error"):
            wait_for(lambda: training_began(run_dir), controller, what="training began")
            began = time.monotonic()
            # A random moment: during a random step (after the checkpoints the fault needs: one
            # to resume from; for a damaged newest one, an intact one before it), a random
            # fraction of a second into it.
            during = rng.randint(NEEDS_CHECKPOINTS.get(fault, 0) + 1, steps - 2)
            wait_for(lambda: last_step(run_dir) >= during - 1, controller, what=f"step {during - 1}")
            time.sleep(rng.uniform(0.0, 0.5))
            step = last_step(run_dir)
            if step >= steps:
                raise RuntimeError(f"{fault}: the run had finished before the fault; give it more --steps")
            outcome.at = f"step {step + 1} ({time.monotonic() - began:.1f} s in)"
            replaced = INJECT[fault](controller, run_dir, work)
            if isinstance(replaced, str):  # what the injection saw
                outcome.at += f"; {replaced}"
                replaced = None
            if replaced is not None:  # killed, and resumed by a new controller
                outcome.codes.append(controller.proc.returncode)
                controller = replaced
        outcome.codes.append(controller.wait())
        outcome.stderr = controller.stderr()  # the first process that stopped: what the user saw
        if fault in AFTER:
            later = AFTER[fault](run_dir, work)
            outcome.codes.append(later.wait())
    finally:
        for pid in workers(run_dir).values():  # nothing of the run outlives it
            signal_pid(pid, signal.SIGCONT)
        if mount is not None:
            shutil.copytree(run_dir, work / "run", dirs_exist_ok=True)  # kept for the outcome
            subprocess.run(["umount", str(mount)], check=False)
            run_dir = work / "run"
    return judge(outcome, run_dir, steps)


def _kill_worker(role: str, sig: int):
    def inject(controller: Controller, run_dir: Path, work: Path) -> None:
        signal_pid(workers(run_dir)[f"{role}-0"], sig)
    return inject


def _kill_controller(damage=None, damage_log=None):
    def inject(controller: Controller, run_dir: Path, work: Path) -> Controller:
        orphans = workers(run_dir)
        controller.proc.kill()
        controller.wait()
        time.sleep(3.0)  # its workers see it gone and exit
        stop_orphans(orphans)
        if damage is not None:
            damage(checkpoints(run_dir)[0] / "writer")
        if damage_log is not None:
            damage_log(run_dir / "events.log")
        return resume(run_dir, work / STDERR)
    return inject


def zero_middle(path: Path, nbytes: int = 64) -> None:
    """`nbytes` zeroed halfway through the file: intact frames stay after them."""
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        fh.write(bytes(nbytes))


def halve(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


STALL_S = 20.0  # the controller stall: four times the job's heartbeat timeout


def _stall_controller(controller: Controller, run_dir: Path, work: Path) -> None:
    """SIGSTOP the controller for STALL_S: every worker finds it silent and leaves."""
    controller.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        controller.proc.send_signal(signal.SIGCONT)


def _damage_state_then_kill_trainer(controller: Controller, run_dir: Path, work: Path) -> None:
    """A flipped byte in the newest checkpoint's training state, then the trainer killed:
    its agent is restored from a checkpoint during the run."""
    flip_byte(checkpoints(run_dir)[0] / "writer" / "training_state.flexmarl")
    signal_pid(workers(run_dir)["trainer-0"], signal.SIGKILL)


LARGE_PROMPT_CHARS = 3 * 1024 * 1024  # "7 " each: 6 MiB of text, under the 8 MiB body cap


def _large_request(controller: Controller, run_dir: Path, work: Path) -> str:
    """A text completion of 6 MiB with a live episode's key, to the run's own endpoint."""
    import json
    import urllib.error
    import urllib.request

    key = (work / "keys").read_text().split()[-1]
    url = (run_dir / "openai.url").read_text().strip()
    body = json.dumps({"model": "writer", "prompt": "7 " * LARGE_PROMPT_CHARS}).encode()
    request = urllib.request.Request(f"{url}/completions", data=body, headers={
        "authorization": f"Bearer {key}", "content-type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            status = answer.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, TimeoutError) as exc:
        return f"no answer ({exc})"
    return f"answered {status} in {time.monotonic() - t0:.1f} s"


def _interrupt(controller: Controller, run_dir: Path, work: Path) -> None:
    controller.proc.send_signal(signal.SIGINT)


def _fill_disk(controller: Controller, run_dir: Path, work: Path) -> None:
    """Writes a file beside the run directory until not one byte more fits."""
    fd = os.open(run_dir.parent / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:  # full for writes of this size: on with smaller ones
                pass
    finally:
        os.close(fd)


def _free_and_resume(run_dir: Path, work: Path) -> Controller:
    (run_dir.parent / "filler").unlink()
    return resume(run_dir, work / STDERR)


INJECT = {
    "stall-controller": _stall_controller,
    "zero-log": _kill_controller(damage_log=zero_middle),
    "halve-log": _kill_controller(damage_log=halve),
    "damage-state": _damage_state_then_kill_trainer,
    "large-request": _large_request,
    "kill-rollout": _kill_worker("rollout", signal.SIGKILL),
    "stop-rollout": _kill_worker("rollout", signal.SIGSTOP),
    "kill-trainer": _kill_worker("trainer", signal.SIGKILL),
    "kill-controller": _kill_controller(),
    "flip-weights": _kill_controller(lambda agent_dir: flip_byte(agent_dir / "model.safetensors")),
    "cut-state": _kill_controller(lambda agent_dir: os.truncate(agent_dir / "training_state.flexmarl", 4096)),
    "ctrl-c": _interrupt,
    "disk-full": _fill_disk,
    "workflow-error": None,
    "missing-field": None,
}
NEEDS_CHECKPOINTS = {"flip-weights": 2, "cut-state": 2, "disk-full": 1, "kill-controller": 1, "ctrl-c": 1,
                     "zero-log": 2, "halve-log": 2, "damage-state": 2}
# Faults that need the job otherwise: flags to `flexmarl run`, environment (WORK: the fault's folder).
# The stall: sync mode, episodes that wait (the pipeline idles, waiting for samples, when the
# trainer dies with the stall); the damaged state likewise (the damaged checkpoint stays the
# newest until the trainer is killed). The large request: the run's endpoint, each episode's key written.
JOB_SETTINGS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "stall-controller": (("--mode", "sync"), {"FAULT_SLEEP_S": "1.5"}),
    "damage-state": (("--mode", "sync"), {"FAULT_SLEEP_S": "1.5"}),  # the trainer dies before the next checkpoint
    "large-request": (("--set", "openai.enabled=true"), {"FAULT_KEY_FILE": "WORK/keys", "FAULT_SLEEP_S": "0.5"}),
}
AFTER = {"ctrl-c": lambda run_dir, work: resume(run_dir, work / STDERR), "disk-full": _free_and_resume}


def table(outcomes: list[Outcome]) -> str:
    head = ["fault", "injected at", "outcome", "exit codes", "resumed from step", "lost", "trained twice",
            "replay --check", "tracebacks", "shm left", "left out (log damage)", "last line of stderr"]
    rows = [head, ["---"] * len(head)] + [o.row() for o in outcomes]
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows)
