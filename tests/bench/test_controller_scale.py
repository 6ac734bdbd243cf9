"""bench/system/controller_scale.py: the real controller against a fake cluster of a few hundred
instances over real sockets; the accounting reconciles and the log replays. Not timed."""

import collections
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "system" / "controller_scale.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("controller_scale", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_few_hundred_fake_instances_train_every_sample_exactly_once_and_the_log_replays(tmp_path):
    bench = load_bench()
    point = {"instances": 256, "agents": 8, "trainers": 16, "mode": "async", "k": 1, "steps": 3, "queries": 24}
    row = bench.one_point(point, keep=str(tmp_path / "point"), replay=True)

    expected = 3 * 24 * 52  # steps x queries x samples per chain episode (4 + 16 + 32)
    assert row["episodes_failed"] == 0
    assert row["fake_errors"] == []  # no trainer saw a sample twice, or a step over other counts
    assert (row["generated"], row["samples"], row["dropped"]) == (expected, expected, 0)
    assert row["accounting"] is True  # what each fake trainer trained, per agent, is what the controller counted
    assert row["replay_ok"] is True, row["replay_problem"]
    assert row["replay_cli_ok"] is True  # the command itself, in a fresh process, checks the log too

    events, problem = read_events(row["events_log"])
    assert problem is None
    opened = [(e.key, j) for e in events if isinstance(e, ev.GroupOpened) for j in range(e.n)]
    formed = collections.Counter(s for e in events if isinstance(e, ev.MicroBatchFormed) for s in e.parts.samples())
    assert len(opened) == expected
    assert set(formed) == set(opened) and set(formed.values()) == {1}  # every sample in one micro-batch
    steps = [e for e in events if isinstance(e, ev.OptimizerStep)]
    assert len(steps) == 3 * 8  # one per agent per batch
    assert sum(e.samples for e in steps) == expected
    summary = replay.summarize(events)
    assert summary.errors == []
    assert replay.check(events) is None


def test_the_bench_smoke_run_prints_a_row_that_parses(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(BENCH), "--smoke", "--keep", str(tmp_path / "smoke")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    for key in ("samples_s", "cpu_us_sample", "lag_p50_ms", "lag_p99_ms", "log_mb_s", "rss_mb", "waited",
                "loop_runq_frac"):
        assert key in row
    # the fake cluster's CPU, measured: its seconds (the share is rounded to two places and reads
    # 0.0 when the fakes got under half a percent of their cores on a loaded machine)
    assert row["cluster_cpu_s"] > 0 and row["cluster_cpu_frac"] >= 0 and row["cluster_runq_frac"] >= 0
    assert 0 < row["loop_cpu_frac"] <= row["cpu_frac"] + 0.01  # the loop's thread is part of the process
    assert row["samples"] == row["generated"] > 0
    assert row["accounting"] is True
    assert "| inst |" in out.stdout  # and the table


def test_a_profile_reads_back_as_shares_by_module(tmp_path):
    """--by-module sums a cProfile file's own time by where the code lives: our modules by
    name, a library by its package, the standard library by its module or package."""
    import cProfile
    import json as json_module

    def work():
        for _ in range(200):
            json_module.dumps({"a": list(range(50))})
            replay.summarize([])

    profile = tmp_path / "p.prof"
    cProfile.runctx("work()", {"work": work}, {}, str(profile))
    bench = load_bench()
    shares = dict(bench.by_module(str(profile), top=100))
    assert abs(sum(shares.values()) - 1.0) < 1e-9
    assert "controller.replay.summary" in shares and "json" in shares and "built-ins" in shares
    assert bench.module_of("/x/site-packages/zmq/sugar/socket.py") == "zmq"
    assert bench.module_of("/usr/lib/python3.11/selectors.py") == "selectors"
    assert bench.module_of("/usr/lib/python3.11/asyncio/base_events.py") == "asyncio"
    out = subprocess.run([sys.executable, str(BENCH), "--by-module", str(profile)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "% " in out.stdout.splitlines()[0], out.stderr[-2000:]


def test_pinned_the_fake_cluster_runs_one_helper_per_core_it_has_and_unpinned_256_instances_to_a_helper():
    bench = load_bench()
    point = {"instances": 1024, "trainers": 64}
    pinned = bench.helper_workers(point, {1})
    assert len(pinned) == 1 and len(pinned[0]) == 1024 + 64
    shared = bench.helper_workers(point, {1, 2, 3})
    assert len(shared) == 3 and sorted(w for h in shared for w in h) == sorted(pinned[0])
    unpinned = bench.helper_workers(point)
    assert [len(h) for h in unpinned] == [256, 256, 256, 256, 64]
    assert {role for role, _ in unpinned[-1]} == {"trainer"}


def test_the_wide_shape_placed_by_chain_is_placed_again_by_the_tokens_sent_and_the_log_replays(tmp_path, caplog):
    # The real controller over real sockets: `router.placement` decides how many of the 64
    # instances each of the 8 agents gets first (every wide episode asks each agent alike);
    # after the first step `router.measured_placement` shares them out by the tokens sent.
    bench = load_bench()
    point = {"instances": 64, "agents": 8, "trainers": 8, "shape": "wide", "mode": "async", "k": 1, "steps": 3,
             "queries": 8}
    with caplog.at_level(logging.INFO, logger="flexmarl"):
        parallel = bench.one_point({**point, "placement": "parallel"})
    assert (parallel["instances_min"], parallel["instances_max"], parallel["instances_moved"]) == (8, 8, 0)
    assert "unevenly loaded" not in caplog.text and "placed by the tokens sent" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flexmarl"):
        measured = bench.one_point(point, replay=True)  # the default: by position, 1 : 2 : ... : 8, then measured
    assert (measured["placement"], measured["instances_min"], measured["instances_max"]) == ("chain", 8, 8)
    assert measured["instances_moved"] == 6 + 4 + 3 + 1  # agent00 .. agent03 had 2, 4, 5 and 7
    placed = [r.getMessage() for r in caplog.records if "placed by the tokens sent" in r.getMessage()]
    assert len(placed) == 1 and "each instance of agent00 was sent 7.0x the tokens of each of agent07's through " \
                                "step 1" in placed[0] and "agent00 2 -> 8" in placed[0], placed
    assert "unevenly loaded" not in caplog.text
    assert measured["replay_ok"] is True, measured["replay_problem"]  # the moves re-derived from the measurement
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flexmarl"):
        kept = bench.one_point({**point, "measured": False})
    assert (kept["instances_min"], kept["instances_max"], kept["instances_moved"]) == (2, 14, 0)
    hint = [r.getMessage() for r in caplog.records if "unevenly loaded" in r.getMessage()]
    assert len(hint) == 1 and "through step 1, agent00 (2 instances) was sent 7.0x the tokens per instance of agent07 (14 instances)" in hint[0]
    assert "the tokens sent fit router.placement = 'parallel' (every unit's share within 1.0x): set it" in hint[0]
    for row in (parallel, measured, kept):
        assert row["accounting"] is True and row["episodes_failed"] == 0
        assert 0.0 < row["rollout_busy"] <= row["rollout_busy_max"] <= 1.0


class _Replies:
    """Stands in for a fake worker's session: keeps what it sends."""

    def __init__(self) -> None:
        self.sent = []

    async def send(self, msg, buffers=()):
        self.sent.append(msg)


async def test_a_fake_engine_swaps_another_agents_weights_in_place_only_with_nothing_of_its_own_queued():
    from flexmarl.controller.testing.fake_cluster import DEFAULT_COSTS, FakeEngine
    from flexmarl.runtime import protocol
    from flexmarl.runtime.params.types import Location, ParamHandle

    def handle(agent, version):
        return ParamHandle(transport="shm", agent=agent, version=version, key=f"t/{agent}/{version}", layout=[],
                           total_bytes=0, checksum=None, publisher=Location("host", 1))

    engine = FakeEngine("rollout-0", dict(DEFAULT_COSTS))
    engine.session = _Replies()
    engine.agent, engine.version = "agent00", 3  # serving agent00 after a sync

    engine.queued = 1  # one GENERATE of agent00 still queued: agent01's weights are refused
    await engine._weights(protocol.LoadWeights(1, "agent01", 2, handle("agent01", 2)))
    assert isinstance(engine.session.sent[-1], protocol.Error)
    assert "GENERATEs queued" in engine.session.sent[-1].message
    assert (engine.agent, engine.version) == ("agent00", 3)

    engine.queued = 0  # drained: the same load swaps the instance to agent01 at its version
    await engine._weights(protocol.LoadWeights(2, "agent01", 2, handle("agent01", 2)))
    reply = engine.session.sent[-1]
    assert isinstance(reply, protocol.WeightsLoaded) and (reply.agent, reply.version) == ("agent01", 2)
    assert (engine.agent, engine.version) == ("agent01", 2)

    # A handle of another version than the one named is refused whatever is queued.
    await engine._weights(protocol.LoadWeights(3, "agent01", 3, handle("agent01", 2)))
    assert isinstance(engine.session.sent[-1], protocol.Error)
    assert (engine.agent, engine.version) == ("agent01", 2)
