"""A real rollout worker process, driven over ZeroMQ by a bare controller socket: a batch
with prompts the engine refuses comes back with those samples refused and the others done,
and the same process goes on serving."""

import asyncio
import os
import random
import subprocess
import sys

import pytest

from flexmarl.controller.tasks import digit_chain as tasks
from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.transport import RouterSocket
from flexmarl.workers import models

pytestmark = pytest.mark.slow


def key(call):
    return p.GroupKey("e", "planner", call)


async def until(router, request_id, kind, timeout=120):
    """Messages for request_id up to the first of `kind` that ends it; fails on an Error."""
    replies = []
    while True:
        inbound = await asyncio.wait_for(router.recv(), timeout)
        msg = inbound.msg
        if isinstance(msg, p.Error) and msg.request_id == request_id:
            raise AssertionError(f"worker failed request {request_id}: {msg.message}")
        if getattr(msg, "request_id", None) == request_id:
            replies.append(msg)
            if isinstance(msg, kind) and getattr(msg, "done", True):
                return replies


async def test_a_worker_process_refuses_bad_prompts_alone_and_keeps_serving(tmp_path):
    model_dir = models.build_model(tasks.AGENTS["planner"], tasks.VOCAB, tmp_path / "planner")
    router = RouterSocket(TransportConfig(address="tcp://127.0.0.1:0"))
    router.bind()
    worker = subprocess.Popen(
        [sys.executable, "-m", "flexmarl.workers.main", "--role", "rollout", "--connect", router.address,
         "--worker-id", "rollout-x", "--handshake-timeout", "60"],
        env=dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        hello = await asyncio.wait_for(router.recv(), 60)
        identity = hello.identity
        await router.send(identity, p.Welcome(p.PROTOCOL_VERSION, 0.5, 600.0))
        await router.send(identity, p.LoadModel(1, "planner", str(model_dir), 0, max_model_len=64))
        await until(router, 1, p.ModelLoaded)

        rng = random.Random(1)
        good = [p.GenGroup(key(f"good-{i}"), "planner", 2, tasks.planner_prompt(tasks.make_query(rng)), 6, 1.0, i,
                           ignore_eos=True) for i in range(3)]
        bad = [p.GenGroup(key("empty"), "planner", 2, [], 6, 1.0, 0),
               p.GenGroup(key("oov"), "planner", 2, [tasks.BOS_ID, 10_000], 6, 1.0, 0)]
        await router.send(identity, p.Generate(2, [bad[0], *good, bad[1]]))
        replies = await until(router, 2, p.Generated)
        results = {r.key: r for m in replies for r in m.results}
        refused = {r.key: r.reason for m in replies for r in m.refused}
        assert sorted(results) == [key("good-0"), key("good-1"), key("good-2")]
        assert all(r.lengths == [6, 6] for r in results.values())
        assert sorted(refused) == [key("empty"), key("oov")] and "vocabulary" in refused[key("oov")]

        await router.send(identity, p.Generate(3, [p.GenGroup(key("later"), "planner", 1, good[0].prompt_ids, 6, 1.0, 0)]))
        replies = await until(router, 3, p.Generated)
        assert [r.key for m in replies for r in m.results] == [key("later")]
        assert worker.poll() is None

        await router.send(identity, p.Shutdown("test over"))
        assert await asyncio.to_thread(worker.wait, 60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        router.close()
