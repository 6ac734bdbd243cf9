"""The actor a Ray node runs for one worker, as a plain object: it starts the process it
is given with the keys in a private folder, hands back its output by offset, stops it,
and removes what it wrote. A stand-in Python process takes the worker's place."""

import os
import signal
import stat

from flexmarl.controller.launch.ray_actor import WorkerActor

# Prints its arguments, waits for SIGTERM, says so and exits 3.
STAND_IN = ("import signal, sys, time\n"
            "print(' '.join(sys.argv[1:]), flush=True)\n"
            "signal.signal(signal.SIGTERM, lambda *a: (print('terminated', flush=True), sys.exit(3)))\n"
            "time.sleep(60)\n")


def wait_for(predicate, timeout=20.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_worker_gets_its_keys_in_a_private_folder_and_its_parent_pid_and_stops_on_request():
    actor = WorkerActor(["-c", STAND_IN], {"FLEXMARL_TEST": "1"},
                        {"server.key": b"public", "client.key": b"c-public", "client.key_secret": b"c-secret"})
    try:
        home = actor.home
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert stat.S_IMODE((home / "client.key_secret").stat().st_mode) == 0o600
        assert (home / "server.key").read_bytes() == b"public" and not (home / "server.key_secret").exists()
        wait_for(lambda: actor.output(0))
        first = actor.output(0)
        assert first.decode().split() == ["--parent-pid", str(os.getpid()), "--curve-dir", str(home)]
        assert actor.output(len(first)) == b""  # nothing new past what was read
        assert actor.stop(timeout=10) == 3
        assert actor.wait() == 3
        assert actor.finish(len(first)) == b"terminated\n"
        assert not home.exists()
    finally:
        if actor.proc.poll() is None:
            actor.proc.kill()
            actor.proc.wait()


def test_a_worker_that_ignores_sigterm_is_killed_after_the_timeout():
    actor = WorkerActor(["-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "print('up', flush=True); time.sleep(60)"], {}, {})
    try:
        wait_for(lambda: actor.output(0))
        assert actor.stop(timeout=0.5) == -signal.SIGKILL
    finally:
        if actor.proc.poll() is None:
            actor.proc.kill()
            actor.proc.wait()
        actor.finish(0)


def test_the_process_sees_the_given_environment_over_the_actors():
    actor = WorkerActor(["-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'] == '', os.environ['PATH'] != '')"],
                        {"CUDA_VISIBLE_DEVICES": ""}, {})
    assert actor.wait() == 0
    assert actor.finish(0).split() == [b"True", b"True"]


def test_a_hung_worker_is_stopped_through_its_actor_and_the_directories_it_left_are_removed(monkeypatch, tmp_path):
    monkeypatch.setattr("flexmarl.runtime.params.shm_segments.memory_dir", lambda: str(tmp_path))
    actor = WorkerActor(["-c", "import os; print(os.environ['FLEXMARL_OWNER_PID'], flush=True); "
                               "import time; time.sleep(60)"], {}, {})
    try:
        wait_for(lambda: actor.output(0))
        assert actor.output(0) == f"{os.getpid()}\n".encode()  # its shared memory is named as the actor's
        (tmp_path / f"flexmarl-lora-{actor.proc.pid}-a").mkdir()
        (tmp_path / f"flexmarl-lora-{os.getpid()}-b").mkdir()  # a running process's: kept
        actor.signal(signal.SIGKILL)
        assert actor.wait() == -signal.SIGKILL
        actor.signal(signal.SIGTERM)  # already gone: nothing to do
        assert actor.reclaim() == 1
        assert [p.name for p in tmp_path.iterdir()] == [f"flexmarl-lora-{os.getpid()}-b"]
    finally:
        if actor.proc.poll() is None:
            actor.proc.kill()
            actor.proc.wait()
        actor.finish(0)
