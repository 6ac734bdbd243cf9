"""A run across network namespaces on this machine: the controller on one "host", the
trainer and an environment worker on a second, the rollout workers on a third, each with its own address and
hostname, over TCP with CURVE on (a worker without the keys never registers), the run's
processes started by the scripts in scripts/. Weights travel trainer to rollout over the
parameter channel's tcp transport (the hosts differ), on the addresses facing the
controller. The run must finish and replay.

Skipped, saying why, where namespaces cannot be made (not root, no iproute2)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events
from flexmarl.runtime.transport import create_curve_keys

sys.path.insert(0, str(Path(__file__).parent))
import netns  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FLEXMARL = ROOT / ".venv" / "bin" / "flexmarl"
PORT = 5555
WHY_NOT = netns.available() or ("" if FLEXMARL.exists() else f"{FLEXMARL} is missing; the scripts run it")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)]


def start(argv, log_path):
    log = open(log_path, "wb")
    env = {**os.environ, "FLEXMARL_SKIP_SETUP": "1", "OMP_NUM_THREADS": "1"}  # set up already; no network there
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    log.close()
    return proc


def stop(procs):
    """Ends what is left of the process groups this test started (each script and the
    workers it started share one), by their ids."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def tail(path, n=3000):
    return Path(path).read_text(errors="replace")[-n:] if Path(path).exists() else "(no log)"


def test_a_run_across_network_namespaces_with_curve_finishes_and_replays(tmp_path):
    keys, run_dir = tmp_path / "keys", tmp_path / "run"
    create_curve_keys(str(keys))
    procs = []
    with netns.Nodes(f"fm{os.getpid()}", ["ctl", "trn", "rol"]) as nodes:
        address = f"tcp://{nodes['ctl']}:{PORT}"
        try:
            procs.append(start(nodes.command("ctl", [
                "bash", "scripts/start_controller.sh", "examples/default.toml", address, "--steps", "2",
                "--out", str(run_dir), "--no-progress", "--set", f"transport.curve_dir='{keys}'",
                "--set", "pipeline.queries_per_step=4", "--set", "cluster.worker_start_timeout_s=120",
                "--set", "cluster.env_workers=1"]),
                tmp_path / "controller.log"))
            procs.append(start(nodes.command("trn", [
                "bash", "scripts/start_workers.sh", address, "0", "1", "1", "--curve-dir", str(keys)],
                hostname="fm-trainer-host"), tmp_path / "trainer-host.log"))
            procs.append(start(nodes.command("rol", [
                "bash", "scripts/start_workers.sh", address, "3", "0", "--curve-dir", str(keys)],
                hostname="fm-rollout-host"), tmp_path / "rollout-host.log"))
            # A worker without the keys gets nowhere: CURVE is on across the "hosts".
            intruder = start(nodes.command("rol", [
                str(FLEXMARL), "worker", "--role", "rollout", "--connect", address, "--worker-id", "intruder",
                "--handshake-timeout", "5"]), tmp_path / "intruder.log")
            procs.append(intruder)
            controller = procs[0]
            try:
                code = controller.wait(900)
            except subprocess.TimeoutExpired:
                code = None
            logs = "\n".join(f"--- {name}\n{tail(tmp_path / name)}" for name in
                             ("controller.log", "trainer-host.log", "rollout-host.log"))
            assert code == 0, f"the controller ended with {code}:\n{logs}"
            for proc in procs[1:3]:  # the workers leave on the controller's SHUTDOWN
                assert proc.wait(60) == 0, logs
            assert intruder.wait(60) == 3 and "no WELCOME" in tail(tmp_path / "intruder.log")
        finally:
            stop(procs)

    events, damage = read_events(run_dir / "events.log")
    assert damage is None
    joined = {e.worker: e.host for e in events if isinstance(e, ev.WorkerJoined)}
    assert joined == {"trainer-fm-trainer-host-0": "fm-trainer-host", "env-fm-trainer-host-0": "fm-trainer-host",
                      **{f"rollout-fm-rollout-host-{i}": "fm-rollout-host" for i in range(3)}}
    syncs = [e for e in events if isinstance(e, ev.WeightSyncStarted)]
    assert syncs and {e.transport for e in syncs} == {"tcp"}  # another host: parameters over tcp
    finished = [e for e in events if isinstance(e, ev.WeightSyncFinished)]
    assert len(finished) == len(syncs) and all(e.nbytes > 0 for e in finished)
    steps = {(e.agent, e.version) for e in events if isinstance(e, ev.OptimizerStep)}
    assert steps == {(a, v) for a in ("planner", "solver", "checker") for v in (1, 2)}
    check = subprocess.run([str(FLEXMARL), "replay", str(run_dir / "events.log"), "--check"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert replay.check(events) is None
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"fm{os.getpid()}-" not in left  # every namespace made here is gone
