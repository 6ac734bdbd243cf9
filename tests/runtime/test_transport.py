"""The transport's sockets: how the process's ZeroMQ threads are scheduled."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")

_SCHEDULERS = """
import asyncio, json, os, sys, time
from flexmarl.runtime import transport
from flexmarl.runtime.config import TransportConfig

async def main():
    sock = transport.RouterSocket(TransportConfig(io_threads=sys.argv[1]))
    deadline = time.monotonic() + 10  # a thread takes its name (ZMQbg/IO/0) once it runs
    while True:
        names = {t: open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
        if "ZMQbg/IO/0" in names.values() or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    print(json.dumps({name: os.sched_getscheduler(int(t)) for t, name in names.items()
                      if name.startswith("ZMQbg/") or int(t) == os.getpid()}))
    sock.close()

asyncio.run(main())
"""


def _schedulers(how: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _SCHEDULERS, how], capture_output=True, text=True, timeout=60,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_zeromq_io_thread_is_scheduled_batch_and_the_loop_thread_is_not():
    schedulers = _schedulers("batch")
    assert schedulers["ZMQbg/IO/0"] == os.SCHED_BATCH
    assert [s for name, s in schedulers.items() if not name.startswith("ZMQbg/")] == [os.SCHED_OTHER]


def test_normal_leaves_the_zeromq_threads_as_the_system_schedules_them():
    assert set(_schedulers("normal").values()) == {os.SCHED_OTHER}


def test_a_thread_the_system_refuses_to_schedule_is_left_as_it_was():
    from flexmarl.runtime.transport import schedule_io_threads

    assert schedule_io_threads("batch", {2 ** 22 + 12345}) == []  # no such thread: refused, nothing raised
    assert schedule_io_threads("normal", {os.getpid()}) == []
