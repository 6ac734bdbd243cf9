"""Every benchmark in bench/ runs at tiny sizes and prints what it promises (its JSON rows
parsed, or its report's lines where it prints a table), so none breaks unseen. Figures are
not judged here: only that each bench runs to the end and reports every measurement.

Benches that train the default job with real engines and trainers take a minute or more
each and carry the `slow` mark. signals.py, gpu_check.py and controller_scale.py have smoke
runs of their own (test_signals.py, test_gpu_check.py, test_controller_scale.py)."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def run_bench(script: str, *args: str, timeout: float = 600.0) -> str:
    """The bench's standard output; fails the test with its error output if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def json_rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_control_plane_reports_round_trips_pipelining_batches_and_tensor_frames():
    rows = json_rows(run_bench("control_plane.py", "--workers", "1", "--messages", "20", "--inflight", "2",
                               "--tensor-reps", "2"))
    assert [r["measure"] for r in rows] == ["rtt", "pipelined", "batched", "tensor_frame"]
    assert rows[0]["messages"] == 20 and rows[3]["bytes"] == 4 * 1024 * 1024 and rows[3]["ratio"] > 0


def test_param_channel_reports_every_transport_against_a_memory_copy(tmp_path):
    rows = json_rows(run_bench("param_channel.py", "--sizes", "1MB", "--transports", "inproc,shm,tcp,disk",
                               "--reps", "1", "--disk-dir", str(tmp_path)))
    assert {r["transport"] for r in rows} == {"disk", "inproc", "shm", "tcp"}  # shm: per publisher kind
    assert all(r["reps"] == 1 and r["memcpy_gb_per_s"] > 0 for r in rows)


def test_fuzz_rejects_every_bad_frame_on_both_sides_and_nothing_crashes(tmp_path):
    out = run_bench("fuzz.py", "--frames", "50", "--raw-connections", "2", "--max-kib", "4",
                    "--log", str(tmp_path / "fuzz.log"))
    assert out.count("== ") == 2  # the controller's side and the worker's
    assert out.count("all accounted: True") == 2
    assert [line.split()[1] for line in out.splitlines() if line.startswith("crashes")] == ["0", "0"]


def test_load_balance_simulates_every_configuration():
    rows = json_rows(run_bench("load_balance.py", "--kinds", "sim", "--sim-instances", "8", "--sim-queries", "40"))
    assert [r["config"] for r in rows] == ["static", "intra", "hierarchical"]
    assert all(r["kind"] == "sim" and r["instances"] == 8 and r["queries"] == 40 for r in rows)


async def test_agent_cycles_reads_each_agents_rollout_training_and_sync_from_an_event_log(tmp_path):
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.eventlog import EventLog

    log = EventLog(tmp_path / "events.log")
    for v in (1, 2, 3):  # the samples of policy v - 1 train into v
        log.emit(ev.RequestsDispatched("r0", "a", v, [f"s{v}"], 4))
        log.emit(ev.RequestsCompleted("r0", "a", v, [f"s{v}"], [v - 1], 3))
        log.emit(ev.MicroBatchTrained("a", "t0", v, 1, 0.0))
        log.emit(ev.WeightSyncFinished("a", v, 0.0, 8))
    await log.close()
    out = await asyncio.to_thread(run_bench, "agent_cycles.py", str(tmp_path), "--skip", "0")
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["v1", "v2", "v3"]
    assert any(line.startswith("| a | ") for line in lines)  # the agent's medians
    assert any(line.startswith("| a | 1 | ") for line in lines)  # its micro-batches of one sample


@pytest.mark.slow
def test_trainer_group_compares_one_rank_with_a_group_on_the_same_job():
    rows = json_rows(run_bench("trainer_group.py", "--ranks", "2", "--steps", "2", "--micro-batches", "2",
                               "--samples", "4", "--hidden", "128", "--layers", "1"))
    assert [r.get("ranks") for r in rows[:2]] == [1, 2] and "group_over_one_step_time" in rows[-1]


@pytest.mark.slow
def test_pipeline_reports_each_mode_against_sync_and_the_ideal_overlap():
    rows = json_rows(run_bench("pipeline.py", "--steps", "2", "--modes", "sync,async1", "--warmup", "1"))
    assert [(r["mode"], r["max_staleness"]) for r in rows] == [("sync", 0), ("async", 1)]
    assert all(r["failed_episodes"] == 0 and "speedup_vs_sync" in r and r["iter_s"] > 0 for r in rows)


@pytest.mark.slow
def test_load_balance_runs_the_real_job_per_configuration():
    rows = json_rows(run_bench("load_balance.py", "--kinds", "real", "--configs", "static,hierarchical",
                               "--repeats", "1", "--steps", "2", "--rollout-workers", "3"))
    assert [(r["config"], r["kind"]) for r in rows] == [("static", "real"), ("hierarchical", "real")]


@pytest.mark.slow
def test_peer_job_runs_on_flexmarl_with_its_breakdown_and_components():
    rows = json_rows(run_bench("peer_trl.py", "--no-trl", "--modes", "async0", "--steps", "3", "--warmup", "1",
                               "--micro-batch", "16"))
    assert len(rows) == 2 and "components_ms" in rows[-1]
    assert rows[0]["steps"] == 3 and "stages" in rows[0]


@pytest.mark.slow
def test_digit_chain_reference_trains_the_chain_in_one_process():
    out = run_bench("digit_chain_reference.py", "--steps", "1", "--queries", "2")
    lines = out.splitlines()
    assert any(line.startswith("before (sampled, greedy):") for line in lines)
    assert any(line.startswith("step   0 ") for line in lines)
    assert any(line.startswith("after (sampled, greedy):") for line in lines)


@pytest.mark.slow
def test_soak_kills_a_process_and_accounts_for_every_sample(tmp_path):
    out = run_bench("soak.py", "--minutes", "1.5", "--kill-every", "40", "--sample-s", "5",
                    "--checkpoint-every", "2", "--out", str(tmp_path / "soak"), timeout=900)
    assert "killed rollout" in out and "lost or trained twice: none" in out


def test_group_publish_reports_rank_0s_peak_for_a_whole_and_a_streamed_publish(tmp_path):
    rows = json_rows(run_bench("group_publish.py", "--shape", "tiny-qwen2", "--reps", "1", "--models", str(tmp_path)))
    assert [r["way"] for r in rows[:-1]] == ["whole", "streamed"] and rows[-1]["summary"]
    assert all(r["bucket_mb"] > 0 and r["publish_s"] > 0 for r in rows[:-1])
    whole, streamed = rows[:2]  # exact counts: the whole set, then one weight at a time
    assert whole["gathered_held_bytes"] > 2 * whole["largest_weight_bytes"]
    assert streamed["gathered_held_bytes"] == streamed["largest_weight_bytes"]


def test_engine_receive_reports_both_ways_of_loading_into_engines_of_one_and_two_ranks(tmp_path):
    rows = json_rows(run_bench("engine_receive.py", "--shape", "tiny-qwen2", "--reps", "1", "--ranks", "1,2",
                               "--models", str(tmp_path)))
    assert [(r["ranks"], r["way"]) for r in rows] == [(1, "by value"), (1, "in the worker"), (2, "by value"),
                                                      (2, "in the worker")]
    by_value, in_worker = rows[2], rows[3]
    assert by_value["call_bytes"] >= by_value["bytes"] > 100 * in_worker["call_bytes"]  # the handle only
    assert all(r["load_s_median"] > 0 and r["memcpy_gb_per_s"] > 0 for r in rows)


@pytest.mark.slow
def test_openai_overhead_runs_the_same_job_and_episodes_through_ctx_chat_and_the_endpoint():
    rows = json_rows(run_bench("openai_overhead.py", "--smoke", timeout=1200))
    jobs, calls = rows[:3], rows[3:]
    assert [r["job"] for r in jobs] == ["review_chain.toml", "openai_team.toml", "openai_team/review_chain"]
    assert jobs[0]["samples"] > 0 and jobs[1]["samples"] > 0 and jobs[2]["samples_per_s_ratio"] > 0
    assert [r["way"] for r in calls] == ["chat", "endpoint", "endpoint/chat"]
    chat, endpoint, ratio = calls
    assert chat["samples"] == endpoint["samples"] == 2 * 4 and chat["calls"] == endpoint["calls"] == 2 * 5
    assert ratio["samples_per_s_ratio"] > 0 and endpoint["controller_cpu_ms_per_call"] > 0
