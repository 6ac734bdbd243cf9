"""The Ray launcher's parts that need no cluster: where the controller binds, the one
line a missing Ray or a cluster that does not answer gets before anything starts, and how
a hung worker's actor is stopped (over a stand-in for `ray`)."""

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flexmarl.controller.launch.launcher import LaunchError
from flexmarl.controller.launch.launchers import LAUNCHERS
from flexmarl.controller.launch.ray_launcher import (
    KILL_ACTOR_S,
    UNANSWERED_KILL_S,
    RayWorker,
    RayWorkers,
    control_address,
)
from flexmarl.runtime.config import load_config

ROOT = Path(__file__).resolve().parents[3]


def test_a_loopback_address_becomes_this_nodes_cluster_address_with_its_port():
    assert control_address("tcp://127.0.0.1:0", "10.1.2.3") == "tcp://10.1.2.3:0"
    assert control_address("tcp://localhost:5555", "10.1.2.3") == "tcp://10.1.2.3:5555"
    assert control_address("tcp://127.0.0.1:0", "fd00::7") == "tcp://[fd00::7]:0"


def test_an_address_the_user_chose_off_loopback_or_a_cluster_on_loopback_is_kept():
    assert control_address("tcp://10.9.9.9:7000", "10.1.2.3") == "tcp://10.9.9.9:7000"
    assert control_address("tcp://127.0.0.1:0", "127.0.0.1") == "tcp://127.0.0.1:0"  # nodes on one host


def test_without_ray_installed_the_ray_launcher_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is missing
    with pytest.raises(LaunchError) as missing:
        LAUNCHERS["ray"](load_config(None, ["cluster.launcher=ray"]))
    assert "needs Ray, which is not installed" in str(missing.value)
    assert "pip install 'flexmarl[ray]'" in str(missing.value)


def test_a_ray_client_address_is_refused_saying_where_to_run():
    pytest.importorskip("ray")
    with pytest.raises(LaunchError) as refused:
        LAUNCHERS["ray"](load_config(None, ["cluster.launcher=ray", "ray.address='ray://head:10001'"]))
    assert "run `flexmarl run` on a node of the cluster" in str(refused.value)


def test_flexmarl_run_against_a_cluster_that_does_not_answer_stops_with_one_line_and_no_run_directory(tmp_path):
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    # 127.0.0.2 is loopback, and nothing listens on port 1 there.
    done = subprocess.run([sys.executable, "-m", "flexmarl.controller.cli", "run", "--launcher", "ray", "--steps", "1",
                           "--no-progress", "--out", str(run_dir), "--set", "ray.address='127.0.0.2:1'"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("flexmarl:")]
    assert errors == ["flexmarl: no Ray cluster answers at 127.0.0.2:1 (Connection refused); start it with "
                      "`ray start --head`, or set ray.address to its HOST:PORT"]
    assert not run_dir.exists()  # nothing started


class FakeRay:
    """As much of `ray` as watching, stopping and reclaiming a worker's actor uses: calls
    resolve when the test says (`answer`), actors are as alive as the test says; records kills."""

    exceptions = SimpleNamespace(RayError=RuntimeError)

    def __init__(self):
        self.killed = []
        self.answers = {}  # ref -> its value, or the RayError it failed with
        self.states = {}  # actor id -> its state in Ray's control store
        self.dead_nodes = set()
        self._private = SimpleNamespace(state=SimpleNamespace(
            actors=lambda actor_id: {"State": self.states.get(actor_id, "ALIVE")}))

    def answer(self, ref, value):
        self.answers[ref] = value

    def remote(self, **options):
        return lambda cls: cls

    def wait(self, refs, timeout=None, num_returns=1):
        ready = [r for r in refs if r in self.answers]
        return ready, [r for r in refs if r not in self.answers]

    def get(self, ref, timeout=None):
        value = self.answers.get(ref, 2)  # 2: what WorkerActor.reclaim removed
        if isinstance(value, Exception):
            raise value
        return value

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)

    def nodes(self):
        return [{"NodeID": node, "Alive": node not in self.dead_nodes} for node in ("n1", "n2")]


class FakeActor:
    def __init__(self):
        self.calls = []
        self._actor_id = SimpleNamespace(hex=lambda: "a1")
        for method in ("signal", "reclaim"):
            setattr(self, method, SimpleNamespace(remote=lambda *a, m=method: self.calls.append((m, *a)) or
                                                  f"{m}-{len(self.calls)}"))


def ray_worker(tmp_path, placed=True):
    where = {"node": "n1", "ip": "10.0.0.1", "host": "h", "pid": 77} if placed else {}
    return RayWorker("rollout-0", "rollout", tmp_path / "rollout-0.log", "flexmarl-t-rollout-0-1", FakeActor(),
                     "exited-ref", None, 0.0, where)


def ray_workers(ray, tmp_path, clock):
    return RayWorkers(ray, None, None, "t", tmp_path, argv=lambda role, worker_id: [], env={}, keys={},
                      start_timeout_s=60.0, clock=lambda: clock.now)


def test_a_hung_ray_worker_is_signalled_through_its_actor_and_after_sigkill_its_actor_is_killed(tmp_path):
    ray, clock = FakeRay(), SimpleNamespace(now=0.0)
    workers = ray_workers(ray, tmp_path, clock)
    worker = ray_worker(tmp_path)
    workers.procs.append(worker)
    workers.signal(worker, signal.SIGTERM)
    assert worker.actor.calls == [("signal", signal.SIGTERM)] and ray.killed == []
    ray.answer("signal-1", None)  # the actor answered: its process got SIGTERM and stays hung
    workers.signal(worker, signal.SIGKILL)  # its process first, where the actor answers
    assert worker.actor.calls[-1] == ("signal", signal.SIGKILL)
    clock.now = 0.9
    workers.exited()
    assert ray.killed == []
    clock.now = 1.0  # then its actor, whether or not it answered
    workers.exited()
    assert ray.killed == [worker.actor]
    workers.reclaim(worker)  # on its node, by its actor
    assert worker.actor.calls[-1] == ("reclaim",)
    unplaced = ray_worker(tmp_path, placed=False)
    workers.procs = [unplaced]
    workers.signal(unplaced, signal.SIGTERM)  # no process to signal: its actor goes at the next look
    workers.exited()
    workers.reclaim(unplaced)
    assert unplaced.actor.calls == [] and ray.killed[-1] is unplaced.actor


def test_a_ray_worker_whose_call_failed_ends_only_once_ray_holds_its_actor_dead_and_then_says_its_node_was_lost(
        tmp_path):
    ray, clock = FakeRay(), SimpleNamespace(now=0.0)
    workers = ray_workers(ray, tmp_path, clock)
    worker = ray_worker(tmp_path)
    workers.procs.append(worker)
    # Its node is gone, which Ray has not noticed yet: the call fails, the actor is still alive to Ray.
    ray.answer("exited-ref", RuntimeError("The actor a1 is unavailable: The actor is temporarily unavailable"))
    assert workers.exited() == [] and worker.alive()  # restarted now, its successor would go to the lost node
    ray.dead_nodes.add("n1")
    ray.states["a1"] = "DEAD"
    assert workers.exited() == [worker]
    assert worker.why_exited() == ("its Ray actor flexmarl-t-rollout-0-1 (worker pid 77 on node n1 at 10.0.0.1) "
                                   "was lost with its node")


def test_a_hung_ray_worker_whose_actor_does_not_answer_is_left_to_ray_to_declare_lost_before_it_is_killed(tmp_path):
    ray, clock = FakeRay(), SimpleNamespace(now=0.0)
    workers = ray_workers(ray, tmp_path, clock)
    worker = ray_worker(tmp_path)
    workers.procs.append(worker)
    workers.signal(worker, signal.SIGTERM)  # never answered: the actor's node may be gone
    clock.now = 5.0
    workers.signal(worker, signal.SIGKILL)
    clock.now = 5.0 + KILL_ACTOR_S
    workers.exited()
    assert ray.killed == []  # killed now, it would end as killed and its successor go to the lost node
    clock.now = 5.0 + UNANSWERED_KILL_S
    workers.exited()
    assert ray.killed == [worker.actor]  # an actor Ray never gives up on is not waited for forever
