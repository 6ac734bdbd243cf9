"""An environment worker's process pool, with real processes: each call comes back exactly
once, a call that crashes, hangs, blows its memory limit or is cancelled costs its process
only, and a session lives in a process of its own from its open to its close."""

import asyncio

import msgspec
import pytest

from flexmarl.runtime import protocol as p
from flexmarl.runtime.user_modules import import_file
from flexmarl.workers.env.pool import PoolError, ProcessPool

FLOW = '''
import os, time

async def episode(ctx):
    pass

def add(a, b):
    return a + b

def pid():
    return os.getpid()

def boom():
    raise ValueError("bad input")

def segfault():
    os.kill(os.getpid(), 11)

def hang():
    time.sleep(1000)

def hog():
    chunks = []
    while True:
        chunks.append(bytearray(10 ** 7))

def unsendable():
    return object()

async def later(x):
    return x * 2

class Counter:
    def __init__(self, start):
        self.n = start

    def step(self, k):
        self.n += k
        return self.n, os.getpid()

    def crash(self):
        os.kill(os.getpid(), 9)
'''


@pytest.fixture
def flow(tmp_path):
    path = tmp_path / "flow.py"
    path.write_text(FLOW)
    return str(path), import_file(path, "flexmarl_workflow").__name__


def call(call_id, module, name, *args, timeout=20.0, **fields):
    return p.EnvCall(call_id, module, name, msgspec.msgpack.encode([args, {}]), timeout, **fields)


class Pool:
    """A started pool serving in the background; `ask` submits calls and waits for their results."""

    def __init__(self, spec, processes=2, memory_mb=0):
        self.results = {}
        self.arrived = asyncio.Event()
        self.pool = ProcessPool(f"{spec}:episode", processes, 4, memory_mb, self.report)

    def report(self, result):
        assert result.call_id not in self.results, "a call answered twice"
        self.results[result.call_id] = result
        self.arrived.set()

    async def __aenter__(self):
        await self.pool.start()
        self.task = asyncio.create_task(self.pool.run())
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.pool.close()

    async def ask(self, *calls):
        for c in calls:
            self.pool.submit(c)
        return [await self.result(c.call_id) for c in calls]

    async def result(self, call_id):
        while call_id not in self.results:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 60)
        return self.results[call_id]


def value(result):
    assert result.failure == "", result.error
    return msgspec.msgpack.decode(result.value)


async def test_calls_run_in_the_pools_processes_and_a_coroutine_is_run_to_its_end(flow):
    spec, module = flow
    async with Pool(spec) as pool:
        added, doubled, *pids = await pool.ask(call(1, module, "add", 2, 3), call(2, module, "later", 21),
                                               *(call(10 + i, module, "pid") for i in range(6)))
        assert value(added) == 5 and value(doubled) == 42
        assert len({value(r) for r in pids}) <= 2  # two processes served them all


async def test_a_crash_a_hang_and_a_memory_blowup_cost_their_call_and_the_pool_goes_on(flow):
    spec, module = flow
    async with Pool(spec, processes=2, memory_mb=1024) as pool:
        crashed, hung, hogged = await pool.ask(call(1, module, "segfault"), call(2, module, "hang", timeout=1.0),
                                               call(3, module, "hog"))
        assert crashed.failure == "crashed" and "killed by SIGSEGV" in crashed.error
        assert hung.failure == "timeout" and "did not return within 1s" in hung.error
        assert hogged.failure == "raised" and hogged.error.startswith("MemoryError")
        after = await pool.ask(*(call(10 + i, module, "add", i, 1) for i in range(4)))
        assert [value(r) for r in after] == [1, 2, 3, 4]


async def test_a_raised_error_and_an_unsendable_value_fail_their_call_in_one_line(flow):
    spec, module = flow
    async with Pool(spec, processes=1) as pool:
        raised, unsendable = await pool.ask(call(1, module, "boom"), call(2, module, "unsendable"))
    assert raised.failure == "raised" and raised.error.startswith("ValueError: bad input (at ")
    assert "in boom" in raised.error and "\n" not in raised.error and "boom" in raised.detail
    assert unsendable.failure == "unsendable" and "(a object) cannot be sent back" in unsendable.error


async def test_a_cancelled_call_is_stopped_if_running_and_dropped_if_queued(flow):
    spec, module = flow
    async with Pool(spec, processes=1) as pool:
        pool.pool.submit(call(1, module, "hang"))
        pool.pool.submit(call(2, module, "add", 1, 1))
        await asyncio.sleep(0.5)
        pool.pool.cancel([1, 2])
        running, queued = await pool.result(1), await pool.result(2)
        assert running.failure == "cancelled" and "was stopped" in running.error
        assert queued.failure == "cancelled" and "before it ran" in queued.error
        assert value((await pool.ask(call(3, module, "add", 1, 1)))[0]) == 2


async def test_a_session_lives_in_one_process_of_its_own_until_closed(flow):
    spec, module = flow
    async with Pool(spec, processes=1) as pool:
        opened, first, second, closed, late = await pool.ask(
            call(1, module, "Counter", 10, op="open", session="e#1"), call(2, "", "step", 5, session="e#1"),
            call(3, "", "step", 5, session="e#1"), call(4, "", "close", op="close", session="e#1"),
            call(5, "", "step", 1, session="e#1"))
        stateless = value((await pool.ask(call(6, module, "pid")))[0])
    assert opened.failure == "" and closed.failure == ""
    (n1, pid1), (n2, pid2) = value(first), value(second)
    assert (n1, n2) == (15, 20) and pid1 == pid2 != stateless
    assert late.failure == "session_lost"


async def test_a_session_whose_process_dies_is_lost_and_the_others_go_on(flow):
    spec, module = flow
    async with Pool(spec, processes=1) as pool:
        await pool.ask(call(1, module, "Counter", 0, op="open", session="a"),
                       call(2, module, "Counter", 0, op="open", session="b"))
        wrong = (await pool.ask(call(3, "", "step", "not a number", session="a")))[0]
        assert wrong.failure == "raised"  # an error its method raised keeps the session
        crashed = (await pool.ask(call(4, "", "crash", session="a")))[0]
        assert crashed.failure == "crashed" and "SIGKILL" in crashed.error
        lost, other = await pool.ask(call(5, "", "step", 1, session="a"), call(6, "", "step", 2, session="b"))
        assert lost.failure == "session_lost" and "its process" in lost.error
        assert value(other)[0] == 2


async def test_a_workflow_that_does_not_import_refuses_the_pool_with_its_error(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(PoolError, match="could not import the workflow .*ModuleNotFoundError: No module named "
                                        "'no_such_module_here'"):
        await ProcessPool(f"{broken}:episode", 1, 1, 0, lambda r: None).start()
