import re

import pytest

from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import ConfigError, dump_toml, load_config


def test_defaults_load_and_validate():
    cfg = load_config()
    assert cfg.pipeline.mode == "sync"
    assert cfg.transport.address.startswith("tcp://127.0.0.1")


def test_file_then_overrides_win(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[pipeline]\nmode = "async"\nmicro_batch = 8\n[agents.a]\nmodel = "m"\n')
    cfg = load_config(path, ["pipeline.micro_batch=4", "agents.a.lr=0.5", "run.seed=3"])
    assert cfg.pipeline.mode == "async"
    assert cfg.pipeline.micro_batch == 4
    assert cfg.agents["a"].lr == 0.5 and cfg.agents["a"].model == str(tmp_path / "m")  # next to the file
    assert cfg.run.seed == 3


def test_unknown_key_is_named_in_the_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[pipeline]\nmdoe = 'async'\n")
    with pytest.raises(ConfigError, match=r"unknown key 'pipeline.mdoe'.*mode"):
        load_config(path)


def test_wrong_type_is_named_in_the_error():
    with pytest.raises(ConfigError, match=r"pipeline.micro_batch: expected int"):
        load_config(None, ["pipeline.micro_batch=lots"])


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="pipeline.mode"):
        load_config(None, ["pipeline.mode=fast"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/x.toml")


def test_resolved_config_dumps_to_toml_that_loads_back(tmp_path):
    cfg = load_config(None, ["agents.x.model=tiny", "run.steps=3"])
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(path) == cfg


def test_a_group_size_of_one_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[agents.a]\nmodel = "m"\ngroup_size = 1\n')
    with pytest.raises(ConfigError, match="agents.a.group_size must be >= 2.*all-zero advantages"):
        load_config(path)


def test_loss_options_are_checked_by_name_and_reach_the_trainer_resolved():
    cfg = load_config(None, ["agents.a.loss_agg=constant", "agents.a.max_tokens=12", "agents.a.off_policy=ppo_clip",
                             "agents.a.kl_coef=0.05"])
    opts = cfg.agents["a"].loss_options()
    assert (opts.agg, opts.constant, opts.off_policy, opts.kl_coef) == ("constant", 12.0, "ppo_clip", 0.05)
    assert load_config(None, ["agents.b.model=m"]).agents["b"].loss_options() == type(opts)(constant=8.0)
    with pytest.raises(ConfigError, match=r"agents.a.loss_agg: expected one of 'seq_mean', 'token_mean', 'constant'"):
        load_config(None, ["agents.a.loss_agg=mean"])
    with pytest.raises(ConfigError, match=r"agents.a.off_policy: expected one of .tis., .ppo_clip., .token_mis."):
        load_config(None, ["agents.a.off_policy=topr"])
    with pytest.raises(ConfigError, match="kl_coef"):
        load_config(None, ["agents.a.kl_coef=-1"])


def test_restart_and_reconnect_settings_have_defaults_and_refuse_negative_values():
    cfg = load_config(None, [])
    assert cfg.cluster.max_restarts == 3 and cfg.transport.reconnect_timeout_s == 60.0
    assert load_config(None, ["cluster.max_restarts=0", "transport.reconnect_timeout_s=0"]).cluster.max_restarts == 0
    with pytest.raises(ConfigError, match="cluster.max_restarts"):
        load_config(None, ["cluster.max_restarts=-1"])
    with pytest.raises(ConfigError, match="transport.reconnect_timeout_s"):
        load_config(None, ["transport.reconnect_timeout_s=-5"])


def test_pure_float16_training_is_refused_with_what_to_use_instead():
    with pytest.raises(ConfigError, match=r"agents.a: dtype float16 with train_precision 'pure'.*eps.*bfloat16"):
        load_config(None, ["agents.a.dtype=float16", "agents.a.train_precision=pure"])
    mixed = load_config(None, ["agents.a.dtype=float16"]).agents["a"]  # float32 master weights: fine
    assert mixed.trainer_settings() == p.TrainerSettings("float16", "mixed", False)


def test_device_and_precision_settings_reach_the_engine_and_trainer_messages():
    cfg = load_config(None, ["agents.a.dtype=bfloat16", "agents.a.gpu_memory_utilization=0.4",
                             "agents.a.tensor_parallel_size=2", "agents.a.train_precision=pure",
                             "agents.a.activation_checkpointing=true", "agents.a.compile_layers=true",
                             "cluster.rollout_gpus=[[0,1],[2,3],[4,5]]"])
    agent = cfg.agents["a"]
    assert agent.engine_settings() == p.EngineSettings("bfloat16", 0.4, 2)
    assert agent.trainer_settings() == p.TrainerSettings("bfloat16", "pure", True, compile_layers=True)
    default = load_config(None, ["agents.b.model=m"]).agents["b"]
    assert default.engine_settings() == p.EngineSettings("auto", 0.9, 1)  # auto: bf16 on CUDA, fp32 on CPU
    assert default.trainer_settings() == p.TrainerSettings("auto", "mixed", False)
    with pytest.raises(ConfigError, match=r"agents.a.dtype: expected one of 'auto', 'bfloat16'"):
        load_config(None, ["agents.a.dtype=bf16"])
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        load_config(None, ["agents.a.gpu_memory_utilization=1.5"])


@pytest.mark.parametrize("overrides, error", [
    (["cluster.rollout_gpus=[[0],[1]]"], "2 GPU lists for 3 workers"),
    (["cluster.trainer_gpus=[[0,0]]"], r"trainer_gpus\[0\] = \[0, 0\]: GPU numbers must be >= 0 and distinct"),
    (["cluster.trainer_group_size=2", "cluster.trainer_gpus=[[3]]"], "needs 2 .cluster.trainer_group_size"),
    (["agents.a.tensor_parallel_size=2", "cluster.rollout_gpus=[[0],[1,2],[3,4]]"], r"rollout_gpus\[0\].*at least 2"),
    (["cluster.trainer_group_size=0"], "trainer_group_size must be >= 1"),
])
def test_gpu_lists_that_do_not_fit_their_workers_are_refused_with_the_reason(overrides, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)


def test_gpu_lists_that_fit_are_kept_by_worker():
    cfg = load_config(None, ["cluster.rollout_gpus=[[0],[1],[2]]", "cluster.trainer_group_size=2",
                             "cluster.trainer_gpus=[[4,5]]"])
    assert cfg.cluster.rollout_gpus == [[0], [1], [2]] and cfg.cluster.trainer_gpus == [[4, 5]]


def test_paths_in_a_toml_are_relative_to_its_folder_and_overrides_to_the_working_directory(tmp_path, monkeypatch):
    job = tmp_path / "job"
    job.mkdir()
    (job / "c.toml").write_text('[run]\nworkflow = "flow.py:episode"\n[data]\ntrain = "data/train.jsonl"\n'
                                '[agents.a]\nmodel = "tiny:models.py:writer"\n[agents.b]\nmodel = "tiny:planner"\n'
                                '[agents.c]\nmodel = "../models/c"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(job / "c.toml", ["data.eval=held_out.jsonl"])
    assert cfg.run.workflow == f"{job}/flow.py:episode"
    assert (cfg.data.train, cfg.data.eval) == (f"{job}/data/train.jsonl", f"{elsewhere}/held_out.jsonl")
    assert [c.model for c in cfg.agents.values()] == [f"tiny:{job}/models.py:writer", "tiny:planner",
                                                       f"{tmp_path}/models/c"]
    # The run directory's copy holds them absolute: it loads the same from anywhere.
    (tmp_path / "run.toml").write_text(dump_toml(cfg))
    monkeypatch.chdir(job)
    assert load_config(tmp_path / "run.toml") == cfg


def test_built_in_and_module_workflows_are_not_paths(tmp_path):
    (tmp_path / "c.toml").write_text('[run]\nworkflow = "mypkg.flows:episode"\n')
    assert load_config(tmp_path / "c.toml").run.workflow == "mypkg.flows:episode"
    assert load_config(None, ["run.workflow=digit_chain"]).run.workflow == "digit_chain"


def test_the_in_flight_setting_is_checked_and_applies_only_where_a_sample_may_span_versions():
    with pytest.raises(ConfigError, match="pipeline.in_flight must be one of 'finish', 'keep', 'recompute', got 'wait'"):
        load_config(None, ["pipeline.in_flight=wait"])
    for overrides, applied in ((["pipeline.mode=async", "pipeline.max_staleness=1"], "keep"),
                               (["pipeline.mode=async", "pipeline.max_staleness=0"], "finish"),  # K = 0: exactly sync
                               (["pipeline.mode=sync", "pipeline.max_staleness=1"], "finish")):
        assert load_config(None, ["pipeline.in_flight=keep", *overrides]).in_flight() == applied
    # The default where it applies: a sync never waits for the longest generation.
    assert load_config(None, ["pipeline.mode=async", "pipeline.max_staleness=1"]).in_flight() == "keep"
    assert load_config(None, ["pipeline.mode=async", "pipeline.max_staleness=0"]).in_flight() == "finish"


def test_continuous_admission_and_partial_rollout_are_refused_where_they_cannot_apply():
    ok = ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.in_flight=keep"]
    cfg = load_config(None, [*ok, "pipeline.admission=continuous", "pipeline.partial_rollout=2"])
    assert cfg.pipeline.admission == "continuous" and cfg.pipeline.partial_rollout == 2
    for overrides, message in [
            (["pipeline.admission=eager"],
             "pipeline.admission must be one of 'step', 'continuous', 'capacity', got 'eager'"),
            ([*ok[:2], "pipeline.in_flight=finish", "pipeline.admission=continuous"], "needs in_flight"),
            (["pipeline.admission=continuous"], "needs mode = \"async\" and max_staleness >= 1"),  # sync mode
            (["pipeline.mode=async", "pipeline.in_flight=keep", "pipeline.admission=continuous"],
             "needs mode = \"async\" and max_staleness >= 1"),  # K = 0
            ([*ok, "pipeline.partial_rollout=2"], "pipeline.partial_rollout needs pipeline.admission"),
            ([*ok, "pipeline.admission=continuous", "pipeline.partial_rollout=-1"], "partial_rollout must be >= 0")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, overrides)


def test_capacity_admission_is_refused_where_continuous_admission_is():
    ok = ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.in_flight=keep"]
    cfg = load_config(None, [*ok, "pipeline.admission=capacity", "pipeline.partial_rollout=2"])
    assert cfg.pipeline.admission == "capacity" and cfg.pipeline.partial_rollout == 2
    for overrides, message in [
            ([*ok[:2], "pipeline.in_flight=finish", "pipeline.admission=capacity"],
             "pipeline.admission = 'capacity' needs in_flight"),
            (["pipeline.admission=capacity"], "'capacity' needs mode = \"async\" and max_staleness >= 1"),  # sync
            (["pipeline.mode=async", "pipeline.in_flight=keep", "pipeline.admission=capacity"],
             "'capacity' needs mode = \"async\" and max_staleness >= 1")]:  # K = 0
        with pytest.raises(ConfigError, match=re.escape(message)) as refused:
            load_config(None, overrides)
        assert "\n" not in str(refused.value)  # one line
