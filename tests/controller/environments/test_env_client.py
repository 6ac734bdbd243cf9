"""The controller's environment client against environment workers in real worker sessions
over real ZeroMQ, their pools real processes: calls come back decoded, spread by load; a
worker that dies fails (or, with retries, re-sends) what it held; a timeout cancels the
call on its worker; a session lives on one worker; a worker that cannot import the
workflow stops the start in one line."""

import asyncio
import contextlib
import os
import re

import pytest

from flexmarl.controller.control.server import ControllerServer
from flexmarl.controller.environments.client import EnvCallFailed, EnvClient, EnvSetupFailed, EnvWorkerLost
from flexmarl.runtime.config import EnvConfig, TransportConfig
from flexmarl.runtime.user_modules import import_file
from flexmarl.workers.env.worker import EnvHandler
from flexmarl.workers.session import WorkerSession

CFG = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, handshake_timeout_s=5.0,
                      reconnect_timeout_s=0.0)
PATIENCE = 60.0

FLOW = '''
import os, time

async def episode(ctx):
    pass

def where(x):
    return [x, os.getpid()]

def slow(seconds):
    time.sleep(seconds)
    return os.getpid()

def boom():
    raise KeyError("missing")

class Tally:
    def __init__(self, start):
        self.total = start

    def add(self, k):
        self.total += k
        return self.total
'''


@pytest.fixture
def flow(tmp_path):
    path = tmp_path / "flow.py"
    path.write_text(FLOW)
    return str(path), import_file(path, "flexmarl_workflow")


@contextlib.asynccontextmanager
async def cluster(workflow, workers=("env-0",), retries=0, processes=1):
    server = ControllerServer(CFG)
    server.bind()
    loops = [asyncio.create_task(server.serve()), asyncio.create_task(server.heartbeat())]
    sessions = {w: asyncio.create_task(WorkerSession(CFG, server.address, EnvHandler(), worker_id=w).run())
                for w in workers}
    client = EnvClient(server, f"{workflow}:episode", EnvConfig(processes=processes, retries=retries),
                       worker_wait_s=1.0)
    try:
        await server.wait_for_workers({"env": len(workers)}, PATIENCE)
        await asyncio.wait_for(client.start(list(workers)), PATIENCE)
        server.on_died.append(client.died)
        yield server, client, sessions
    finally:
        await client.close()
        for task in [*sessions.values(), *loops]:
            task.cancel()
        await asyncio.gather(*sessions.values(), *loops, return_exceptions=True)
        server.close()


async def kill(server, sessions, worker):
    """The worker's process is gone, and whoever started it told the controller."""
    sessions[worker].cancel()
    await asyncio.gather(sessions[worker], return_exceptions=True)
    server.worker_exited(worker, "its process exited with code -9")


async def test_calls_return_their_values_from_the_workers_processes_spread_by_load(flow):
    spec, mod = flow
    async with cluster(spec, ("env-0", "env-1")) as (server, client, _):
        results = await asyncio.gather(*(client.call(mod.slow, (0.3,), {}, 30.0) for _ in range(4)))
        assert os.getpid() not in results and len(set(results)) == 2  # one process each, both workers busy
        value, pid = await client.call(mod.where, (("x", 1),), {}, 30.0)
        assert value == ["x", 1] and pid in results  # a tuple comes back as msgpack carries it: a list
        assert client.counts["calls"] == 5 and client.counts["failed"] == 0
        assert all(w.outstanding == 0 for w in client.ready.values())


async def test_an_error_raised_there_is_one_line_naming_the_function_with_the_traceback_as_a_note(flow):
    spec, mod = flow
    async with cluster(spec) as (_, client, _):
        with pytest.raises(EnvCallFailed) as failure:
            await client.call(mod.boom, (), {}, 30.0)
    assert re.fullmatch(r"flow.py:boom failed on env-0: KeyError: 'missing' \(at .*flow.py:\d+ in boom\)",
                        str(failure.value))
    assert "raise KeyError" in failure.value.__notes__[0]  # the user's traceback, for the run's first failure


async def test_a_timeout_cancels_the_call_on_its_worker_which_goes_on(flow):
    spec, mod = flow
    async with cluster(spec) as (_, client, _):
        with pytest.raises(TimeoutError, match=r"flow.py:slow did not return within 0.5s"):
            await client.call(mod.slow, (600,), {}, 0.5)
        assert await client.call(mod.slow, (0,), {}, 60.0) > 0  # its process was stopped, another serves


async def test_a_worker_that_dies_fails_the_calls_it_held_or_with_retries_sends_them_to_another(flow):
    spec, mod = flow
    async with cluster(spec, ("env-0",)) as (server, client, sessions):
        held = asyncio.create_task(client.call(mod.slow, (600,), {}, 60.0))
        await asyncio.sleep(1.0)
        await kill(server, sessions, "env-0")
        with pytest.raises(EnvWorkerLost, match=r"flow.py:slow: worker env-0 is gone: its process exited with code -9"):
            await held
        with pytest.raises(EnvWorkerLost, match="no environment worker was up for 1s and none is being restarted "
                                                r"\(gone: env-0"):
            await client.call(mod.slow, (0,), {}, 60.0)
    async with cluster(spec, ("env-0", "env-1"), retries=1) as (server, client, sessions):
        held = asyncio.create_task(client.call(mod.slow, (2,), {}, 60.0))
        await asyncio.sleep(0.5)
        dying = next(w for w, s in client.ready.items() if s.outstanding)
        await kill(server, sessions, dying)
        assert await held > 0 and client.counts["retried"] == 1


async def test_a_session_lives_on_one_worker_and_is_lost_with_it(flow):
    spec, mod = flow
    async with cluster(spec, ("env-0", "env-1")) as (server, client, sessions):
        env = await client.open_session(mod.Tally, (10,), {}, 30.0, episode="s1q0")
        assert await env.add(5) == 15 and await env.call("add", 1) == 16
        home = client.sessions[env.session_id].worker
        other = await client.open_session(mod.Tally, (0,), {}, 30.0, episode="s1q1")
        assert client.sessions[other.session_id].worker != home  # the fewest sessions first
        env.close_soon()
        await asyncio.sleep(0.1)  # sent with the loop turn's other calls
        assert env.session_id not in client.sessions
        await kill(server, sessions, client.sessions[other.session_id].worker)
        with pytest.raises(EnvWorkerLost, match="its session is lost: its environment worker env-. died"):
            await other.add(1)


async def test_a_worker_that_cannot_import_the_workflow_stops_the_start_in_one_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no config here')\n")
    with pytest.raises(EnvSetupFailed, match=r"^environment worker env-0 cannot run the workflow's functions: an "
                                             r"environment process could not import the workflow .*RuntimeError: no "
                                             r"config here"):
        async with cluster(str(broken)):
            pass
