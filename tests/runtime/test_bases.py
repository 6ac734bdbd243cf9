"""Bases and adapter agents in the configuration: max_loras follows from the agents and
the staleness bound, a base that cannot hold the job is refused at start naming the fix,
and a malformed adapter agent is refused naming its key."""

import pytest

from flexmarl.runtime import bases, config
from flexmarl.runtime.config import ConfigError, dump_toml, load_config

JOB = """
[pipeline]
mode = "async"
max_staleness = 2
in_flight = "finish"  # an agent's requests end under the version they began with: K + 1 of each
[bases.shared]
model = "tiny:base"
[agents.whole]
model = "tiny:planner"
[agents.a]
base = "shared"
lora_rank = 4
[agents.b]
base = "shared"
lora_rank = 12
lora_target_modules = ["q_proj", "v_proj"]
[agents.c]
base = "shared"
"""


def job(tmp_path, text=JOB, overrides=()):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return load_config(path, list(overrides))


def test_max_loras_holds_k_plus_one_versions_of_every_adapter_agent_of_the_base(tmp_path):
    cfg = job(tmp_path)
    assert config.adapter_agents(cfg, "shared") == ["a", "b", "c"]
    slots = bases.lora_slots(cfg, "shared")
    assert slots == config.LoraSlots(max_loras=3 * (2 + 1), max_lora_rank=16, max_cpu_loras=9)
    engine = bases.engine_settings(cfg, "shared")
    assert (engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (9, 16, 9)
    assert bases.lora_settings(cfg.agents["b"]).target_modules == ("q_proj", "v_proj")
    assert bases.lora_settings(cfg.agents["a"]).target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")


def test_sync_mode_needs_one_version_per_agent(tmp_path):
    cfg = job(tmp_path, overrides=["pipeline.mode=sync"])
    assert bases.lora_slots(cfg, "shared").max_loras == 3


def test_a_base_whose_max_loras_cannot_hold_the_job_is_refused_at_start_naming_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"bases.shared.max_loras = 8 cannot run this job: its 3 adapter "
                                          r"agents \(a, b, c\) may each have 3 versions.*Raise max_loras to 9"):
        job(tmp_path, overrides=["bases.shared.max_loras=8"])
    assert bases.lora_slots(job(tmp_path, overrides=["bases.shared.max_loras=12"]), "shared").max_loras == 12


def test_a_max_lora_rank_below_an_agents_rank_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"bases.shared.max_lora_rank = 8 .* 16 would do"):
        job(tmp_path, overrides=["bases.shared.max_lora_rank=8"])


@pytest.mark.parametrize("override, message", [
    ("agents.a.base=nowhere", r"agents.a.base = 'nowhere': no \[bases.nowhere\]"),
    ('agents.a.model="tiny:solver"', r"agents.a.model is set, but agents.a is an adapter of bases.shared.*"
                                     r"set bases.shared.model instead"),
    ('agents.a.dtype="bfloat16"', r"set bases.shared.dtype instead"),
    ("agents.whole.lora_rank=4", r"agents.whole.lora_rank is set but agents.whole is a whole model"),
    ("agents.a.lora_rank=0", r"agents.a.lora_rank must be in \[1, 512\]"),
    ("agents.a.lora_target_modules=[]", r"lora_target_modules is empty"),
    ("cluster.trainer_group_size=2", r"single-process trainers"),
])
def test_a_malformed_adapter_agent_is_refused_naming_its_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        job(tmp_path, overrides=[override])


def test_a_base_without_agents_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"bases.spare has no agents"):
        job(tmp_path, JOB + '[bases.spare]\nmodel = "tiny:base"\n')


def test_adapter_agents_train_with_their_bases_settings_and_the_resolved_config_reloads(tmp_path):
    cfg = job(tmp_path, overrides=['bases.shared.train_precision="pure"'])
    assert bases.trainer_settings(cfg, "a").precision == "pure"
    assert bases.trainer_settings(cfg, "whole").precision == "mixed"
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg))
    assert load_config(again) == cfg


def test_a_base_is_one_engine_unit_for_all_its_adapter_agents_and_a_whole_model_agent_is_its_own(tmp_path):
    cfg = job(tmp_path)
    units = bases.engine_units(cfg)
    assert {name: u.agents for name, u in units.items()} == {"whole": ("whole",), "bases.shared": ("a", "b", "c")}
    assert (units["whole"].lora, units["bases.shared"].lora) == (False, True)
    assert units["bases.shared"].settings == bases.engine_settings(cfg, "shared")  # its engine's LoRA slots
    message = units["bases.shared"].load_message(7, "/models/base", seed=3)
    assert (message.agent, message.model_path, message.version, message.engine.max_loras) == (
        "bases.shared", "/models/base", 0, units["bases.shared"].settings.max_loras)
    assert (bases.model_of(cfg, "b"), bases.model_of(cfg, "whole")) == ("tiny:base", "tiny:planner")
    assert bases.agent_lora(cfg, "whole") is None and bases.agent_lora(cfg, "b").rank == 12


def test_a_bases_model_path_is_relative_to_the_toml_like_an_agents(tmp_path):
    (tmp_path / "job").mkdir()
    text = JOB.replace('model = "tiny:base"', 'model = "tiny:team/models.py:base"')
    cfg = job(tmp_path / "job", text)
    assert cfg.bases["shared"].model == f"tiny:{(tmp_path / 'job' / 'team' / 'models.py').resolve()}:base"


def test_keep_and_recompute_need_one_slot_per_trained_agent_a_snapshot_still_k_plus_one(tmp_path):
    for in_flight in ("keep", "recompute"):
        cfg = job(tmp_path, overrides=[f"pipeline.in_flight={in_flight}"])
        assert bases.lora_slots(cfg, "shared") == config.LoraSlots(max_loras=3, max_lora_rank=16, max_cpu_loras=3)
    cfg = job(tmp_path, overrides=["pipeline.in_flight=finish"])
    assert bases.lora_slots(cfg, "shared").max_loras == 9
    # A snapshot's refreshes let its requests finish under the old version: K + 1 for it.
    cfg = job(tmp_path, JOB + '[agents.past]\nsnapshot_of = "a"\n', overrides=["pipeline.in_flight=keep"])
    assert bases.lora_slots(cfg, "shared").max_loras == 3 + (2 + 1)
    # A frozen adapter agent (no snapshot) never loads a second version: one slot, whatever
    # the setting.
    for in_flight in ("keep", "finish"):
        cfg = job(tmp_path, JOB + '[agents.judge]\nbase = "shared"\nlora_rank = 16\ntrain = false\nadapter = "judge_adapter"\n',
                  overrides=[f"pipeline.in_flight={in_flight}"])
        assert bases.lora_slots(cfg, "shared").max_loras == (3 if in_flight == "keep" else 9) + 1
    with pytest.raises(ConfigError, match=r"may have 3, 3, 3 and 1 versions in use at once"):
        job(tmp_path, JOB + '[agents.judge]\nbase = "shared"\nlora_rank = 16\ntrain = false\nadapter = "judge_adapter"\n',
            overrides=["bases.shared.max_loras=8"])
