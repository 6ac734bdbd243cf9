"""Every benchmark in bench/ runs at tiny sizes and prints what it promises (its JSON rows
parsed, or its report's lines where it prints a table), so none breaks unseen. Figures are
not judged here: only that each bench runs to the end and reports every measurement.

Benches that train the default job with real engines and trainers take a minute or more
each and carry the `slow` mark. signals.py, gpu_check.py, controller_scale.py and real_size.py have smoke
runs of their own (test_signals.py, test_gpu_check.py, test_controller_scale.py, test_real_size.py)."""

import asyncio
import importlib.util
import json

import pytest

from bench_runs import ROOT, json_rows, run_bench


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
    from flexmarl.runtime.keys import GroupKey

    log = EventLog(tmp_path / "events.log")
    for v in (1, 2, 3):  # the samples of policy v - 1 train into v
        part = ev.Parts([GroupKey("e", "a", f"g{v}")], [0], [1])
        log.emit(ev.RequestsDispatched("r0", "a", v, 4, part))
        log.emit(ev.RequestsCompleted("r0", "a", v, [v - 1], 3, parts=part))
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
def test_prefill_reports_what_a_jobs_engines_computed_of_their_prompts():
    (row,) = json_rows(run_bench("prefill.py", "--smoke"))
    assert row["job"] == "default" and row["samples"] == 2 * 52 and row["replay_ok"] is True
    assert row["prefilled_per_sample"] > 0 and 0 <= row["first_hit_rate"] <= 1
    assert row["later_hit_rate"] is None  # the digit chain has no later turns


@pytest.mark.slow
def test_soak_kills_a_process_and_accounts_for_every_sample(tmp_path):
    out = run_bench("soak.py", "--minutes", "1.5", "--kill-every", "40", "--sample-s", "5",
                    "--checkpoint-every", "2", "--out", str(tmp_path / "soak"), timeout=900)
    assert "killed rollout" in out and "lost or trained twice: none" in out


@pytest.mark.slow
@pytest.mark.parametrize("target", ["serve", "train"])
def test_serve_soak_loads_an_endpoint_and_reports_requests_latency_and_every_processs_memory(tmp_path, target):
    out = run_bench("serve_soak.py", "--target", target, "--minutes", "0.4", "--clients", "4", "--sample-s", "3",
                    "--hostile", "0.2", "--rollout-workers", "1", "--out", str(tmp_path / target), timeout=1200)
    (row,) = json_rows(out)
    assert row["target"] == target and row["answered"] > 0 and row["errors"] == 0
    assert (row["meant_refusals"] > 0) == (target == "serve")  # the malformed share is the served target's
    names = {name.split(":")[0] for name in row["rss_mib"]}
    assert names >= ({"serve", "serve-0"} if target == "serve" else {"controller", "rollout-0", "trainer-0"})


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
def test_ray_launch_runs_the_default_job_with_each_launcher_and_reports_both():
    rows = json_rows(run_bench("ray_launch.py", "--steps", "1", "--queries", "4", "--repeats", "1"))
    assert [r.get("launcher", r.get("measure")) for r in rows] == ["cluster_start", "local", "ray", "medians"]
    runs = rows[1:3]
    assert all(r["steps"] == 1 and r["samples"] > 0 and r["setup_s"] > 0 and r["samples_per_s"] > 0 for r in runs)
    assert rows[3]["setup_ratio_ray_over_local"] > 0 and rows[3]["samples_per_s_ratio_ray_over_local"] > 0


def test_sync_stages_reports_each_stage_of_a_weight_sync_against_a_memory_copy(tmp_path):
    rows = json_rows(run_bench("sync_stages.py", "--smoke", "--models", str(tmp_path)))
    assert [r["stage"] for r in rows] == ["step", "publish", "receive", "copy", "re-pack", "all"]
    assert all(r["bytes"] > 0 and r["memcpy_s"] > 0 and r["s"] >= 0 for r in rows)
    assert rows[-1]["s"] == pytest.approx(sum(r["s"] for r in rows[:-1]), abs=1e-3)


@pytest.mark.slow
def test_openai_overhead_runs_the_same_job_and_episodes_through_ctx_chat_and_the_endpoint():
    rows = json_rows(run_bench("openai_overhead.py", "--smoke", timeout=1200))
    jobs, calls = rows[:3], rows[3:]
    assert [r["job"] for r in jobs] == ["review_chain.toml", "openai_team.toml", "openai_team/review_chain"]
    assert jobs[0]["samples"] > 0 and jobs[1]["samples"] > 0 and jobs[2]["samples_per_s_ratio"] > 0
    assert [r["way"] for r in calls] == ["chat", "endpoint", "http", "endpoint/chat", "http/chat"]
    chat, endpoint, http, *ratios = calls
    assert chat["samples"] == endpoint["samples"] == http["samples"] == 2 * 4
    assert chat["calls"] == endpoint["calls"] == http["calls"] == 2 * 5
    assert all(r["samples_per_s_ratio"] > 0 for r in ratios) and endpoint["controller_cpu_ms_per_call"] > 0


async def test_replay_parts_times_the_command_and_each_of_its_parts_on_a_log(tmp_path):
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.config import dump_toml, load_config
    from flexmarl.runtime.eventlog import EventLog
    from flexmarl.runtime.keys import GroupKey

    config = load_config(None, ["pipeline.micro_batch=2", "pipeline.queries_per_step=1", "agents.a.model='m'"],
                         defaults={})
    log = EventLog(tmp_path / "events.log")
    log.emit(ev.RunStarted(dump_toml(config), ["a"], "async", 1, 0))
    g = GroupKey("e", "a", "g")
    log.emit(ev.GroupOpened(g, 1, 2))
    log.emit(ev.RequestsCompleted("r0", "a", 1, [0], 3, parts=ev.Parts([g], [0], [2])))
    log.emit(ev.MicroBatchFormed("a", "t0", 1, ev.Parts([g], [0], [2]), [0, 0]))
    log.emit(ev.OptimizerStep("a", "t0", 1, 2))
    await log.close()
    out = await asyncio.to_thread(run_bench, "replay_parts.py", str(tmp_path / "events.log"), "--check",
                                  "--repeats", "2")
    rows = json_rows(out)
    assert [r["repeat"] for r in rows] == [0, 1]
    assert all({"command_s", "import_s", "read_s", "summarize_s", "format_s", "check_s"} <= r.keys() for r in rows)


def test_group_record_reports_training_wire_bytes_and_view_reads():
    rows = json_rows(run_bench("group_record.py", "--smoke"))
    wire = [r for r in rows if "wire" in r]
    assert {(r["wire"], r["agent"]) for r in wire} == {("default", "planner"), ("default", "solver"),
                                                       ("default", "checker"), ("group16", "agent")}
    assert all(r["bytes_per_micro_batch"] > 0 and r["micro_batches"] > 0 for r in wire)
    assert all(r["old_bytes_per_micro_batch"] > 0 for r in wire)  # the same samples in the earlier message shape
    (group16,) = [r for r in wire if r["wire"] == "group16"]
    assert group16["old_bytes_per_micro_batch"] > group16["bytes_per_micro_batch"]  # the prompt once, not 16 times
    views = [r for r in rows if "view" in r]
    assert [r["view"] for r in views] == [f"{n} tokens x 8 choices" for n in (256, 1024, 4096)]
    assert all(r["last_turn_us"] > 0 and r["output_ids_us"] > 0 for r in views)

@pytest.mark.slow
def test_frozen_agents_compares_a_frozen_judge_with_one_trained_at_lr_0():
    rows = json_rows(run_bench("frozen_agents.py", "--smoke"))
    frozen, lr0, ratio = rows
    assert (frozen["mode"], lr0["mode"]) == ("frozen", "lr0")
    assert frozen["trainer_agents"] == ["player"] and lr0["trainer_agents"] == ["judge", "player"]
    assert frozen["judge_micro_batches"] == frozen["judge_weight_syncs"] == 0
    assert lr0["judge_optimizer_steps"] == lr0["judge_weight_syncs"] == 2
    assert len(ratio["lr0_over_frozen_step_s"]) == 1


@pytest.mark.slow
def test_distillation_trains_a_teacher_then_the_student_with_and_without_it():
    rows = json_rows(run_bench("distillation.py", "--smoke", "--modes", "rl,distill,only", timeout=1200))
    assert "teacher_held_out_reward" in rows[0]
    assert 0 < rows[0]["reverse_kl_at_the_students_start"]["wrong_pushed_down"] <= 1
    assert [(r["mode"], r["seed"]) for r in rows[1:4]] == [("rl", 0), ("distill", 0), ("only", 0)]
    assert rows[1]["teacher_kl_first_last"] == [0.0, 0.0] and rows[2]["teacher_kl_first_last"][0] > 0
    assert rows[3]["teacher_kl_first_last"][0] > 0
    assert [r["mode"] for r in rows[4:]] == ["rl", "distill", "only"] and "steps_to_teacher_reward" in rows[4]


@pytest.mark.slow
def test_distillation_with_the_teachers_top_k_prints_the_dense_term():
    rows = json_rows(run_bench("distillation.py", "--smoke", "--modes", "distill", "--top-k", "18", timeout=1200))
    assert rows[1]["mode"] == "distill" and rows[1]["teacher_top_kl_first_last"][0] > 0
    assert rows[1]["teacher_kl_first_last"][0] > 0  # the sampled token's estimate still read


@pytest.mark.slow
def test_distillation_measures_the_teacher_and_the_student_on_a_larger_held_out_set(tmp_path):
    rows = json_rows(run_bench("distillation.py", "--smoke", "--modes", "rl", "--eval-queries", "70",
                               "--teacher-evals", "2", "--out", str(tmp_path), timeout=1200))
    committed = (ROOT / "examples" / "distill" / "eval.jsonl").read_text().splitlines()
    queries = (tmp_path / "held_out.jsonl").read_text().splitlines()
    assert queries[:64] == committed and len(queries) == 70  # the committed ones, then 6 more
    assert len(set(queries[64:])) == 6 and not set(queries[64:]) & set(committed)  # none repeating an earlier one
    assert all(len(json.loads(q)["digits"]) == 3 for q in queries)
    measured, teacher = rows[0]["teacher_on_held_out"], rows[1]
    assert len(measured) == 2 and teacher["teacher_held_out_reward"] == pytest.approx(sum(measured) / 2, abs=1e-4)
    assert teacher["teacher"] == str((tmp_path / "teacher" / "checkpoints" / "final" / "sorter").resolve())
    assert [(r["mode"], r["seed"]) for r in rows[2:3]] == [("rl", 0)]


def distillation_bench():
    spec = importlib.util.spec_from_file_location("distillation_bench", ROOT / "bench" / "system" / "distillation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_distillation_evaluates_the_teacher_and_the_students_the_same_way_with_n_samples_per_query():
    bench = distillation_bench()
    default = bench.parse_args([])
    assert (default.eval_samples, default.eval_temperature, default.episodes) == (1, 1.0, 0)
    args = bench.parse_args(["--eval-samples", "4", "--eval-temperature", "0"])
    args.episodes = args.eval_samples * 256  # main's: N of each of the 256 held-out queries
    assert bench.evaluation(args) == ["eval.episodes=1024", "eval.temperature=0.0"]
    assert bench.parse_args(["--smoke", "--eval-samples", "2"]).episodes == 0  # N per query, not smoke's 4
    assert bench.parse_args(["--smoke"]).episodes == 4
    for wrong in (["--eval-samples", "0"], ["--episodes", "8", "--eval-samples", "2"], ["--modes", "rl,kl"]):
        with pytest.raises(SystemExit):
            bench.parse_args(wrong)


def test_distillation_reads_the_first_step_at_the_teachers_reward():
    bench = distillation_bench()
    assert bench.first_at({2: 0.95, 0: 0.5, 1: 0.9083}, 0.9084) == 2  # in step order; below by 0.0001 is below
    assert bench.first_at({0: 0.5, 1: 0.9084}, 0.9084) == 1
    assert bench.first_at({0: 0.5}, 0.9084) is None


@pytest.mark.slow
def test_distillation_evaluates_n_samples_of_each_held_out_query_greedy(tmp_path):
    rows = json_rows(run_bench("distillation.py", "--smoke", "--modes", "rl", "--eval-queries", "3", "--eval-samples",
                               "2", "--eval-temperature", "0", "--out", str(tmp_path), timeout=1200))
    assert rows[0] == {"teacher_on_held_out": rows[0]["teacher_on_held_out"], "episodes": 6, "temperature": 0.0}
    assert len(rows[0]["teacher_on_held_out"]) == 1  # --teacher-evals' default
    for run in ("teacher-held-out", "rl-0"):
        evals = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                 if '"kind": "eval"' in line]
        assert evals and all(r["samples"] == r["episodes"] == 6 for r in evals)  # 2 of each of the 3 queries
    assert [(r["mode"], r["seed"]) for r in rows[2:3]] == [("rl", 0)]
    assert rows[3]["mean_steps_to_teacher_reward"] in (None, 0, 1, 2)


@pytest.mark.slow
def test_self_play_reports_the_players_reward_per_refresh_of_its_snapshot():
    rows = json_rows(run_bench("self_play.py", "--smoke"))
    assert [r["snapshot_version"] for r in rows] == [0, 1] and all(r["past_score"] is not None for r in rows)


@pytest.mark.slow
def test_dynamic_sampling_runs_the_task_with_and_without_it():
    with_it, without = json_rows(run_bench("dynamic_sampling.py", "--smoke"))
    assert with_it["dynamic_sampling"] and not without["dynamic_sampling"]
    assert with_it["samples"] == [12, 12] and without["groups_equal_dropped"] == [0, 0]


def test_view_load_opens_a_small_synthetic_run_in_a_real_browser():
    from flexmarl.controller.testing.browser import BrowserMissing, headless_chromium

    try:
        headless_chromium()
    except BrowserMissing as exc:
        pytest.skip(f"no headless browser here: {exc}")
    (row,) = json_rows(run_bench("view_load.py", "--synthetic", "3,2,4,16"))
    assert (row["steps"], row["agents"], row["workers"], row["samples"]) == (3, 2, 5, 48)  # 4 instances, 1 trainer
    assert row["page_errors"] == []
    assert 0 < row["listening_s"] <= row["header_s"] <= row["episode_s"] and row["rss_mb"] > 0


def test_view_load_measures_what_an_unwatched_view_costs_an_idle_loop(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    (row,) = json_rows(run_bench("view_load.py", str(tmp_path), "--idle", "0.3"))
    assert row["idle_ms_per_s"] >= 0 and row["view_ms_per_s"] >= 0 and row["events_read"] == 0  # never read


def test_env_scaling_reports_every_cost_for_the_controller_and_for_environment_workers():
    rows = json_rows(run_bench("env_scaling.py", "--costs", "1", "--workers", "0,1", "--seconds", "0.2"))
    assert [(r["ms"], r["workers"]) for r in rows] == [(1.0, 0), (1.0, 1)]
    assert all(r["samples"] >= 128 and r["samples_s"] > 0 and r["ctl_cpu_frac"] > 0 for r in rows)


@pytest.mark.slow
def test_long_tail_reports_each_in_flight_setting_against_finish():
    rows = json_rows(run_bench("long_tail.py", "--steps", "3", "--warmup", "1", "--settings", "finish,keep",
                               "--ks", "1", "--max-tokens", "48", "--queries", "4", "--group-size", "4",
                               "--admission", "step,capacity:1"))
    runs, ratios = rows[:3], rows[3:]
    assert [(r["in_flight"], r["admission"], r["max_staleness"]) for r in runs] == [
        ("finish", "step", 1), ("keep", "step", 1), ("keep", "capacity:1", 1)]  # finish: step admission only
    assert all(r["failed_episodes"] == 0 and r["samples_per_s"] > 0 and len(r["reward"]) == 3 for r in runs)
    assert runs[0]["spanned_parts"] == 0 and runs[1]["sync_wait_s"] >= 0 and len(runs[0]["occupancy"]) == 2
    assert all(r["sync_wait_max_s"] >= 0 for r in runs)
    assert [r["episodes_abandoned"] for r in runs[:2]] == [0, 0] and runs[2]["episodes_abandoned"] >= 0  # step: none
    assert [(r["in_flight"], "samples_per_s_vs_finish" in r) for r in ratios] == [("keep", True), ("keep", True)]
