"""The digit-team example as shipped: its TOML loads (four adapter agents of one base, the
engine's LoRA slots from the agents and the staleness bound), a rank-8 adapter is a small
fraction of its base, and its tasks score exactly."""

from pathlib import Path

from flexmarl.runtime import bases, config
from flexmarl.runtime.config import load_config
from flexmarl.runtime.model_specs import import_job

ROOT = Path(__file__).resolve().parents[2]
tasks = import_job(str(ROOT / "examples" / "digit_team" / "tasks.py"))


def test_the_example_loads_with_four_adapter_agents_of_one_base_and_its_lora_slots():
    cfg = load_config(ROOT / "examples" / "digit_team.toml", [])
    assert config.adapter_agents(cfg, "team") == ["sorter", "expander", "copier", "reverser"]
    assert {n: u.agents for n, u in bases.engine_units(cfg).items()} == {
        "bases.team": ("sorter", "expander", "copier", "reverser")}
    assert bases.lora_slots(cfg, "team") == config.LoraSlots(max_loras=4, max_lora_rank=8, max_cpu_loras=4)
    # Under in_flight "finish" each agent's older version stays loaded while requests use it.
    finish = load_config(ROOT / "examples" / "digit_team.toml", ["pipeline.in_flight=finish"])
    assert bases.lora_slots(finish, "team") == config.LoraSlots(max_loras=4 * 2, max_lora_rank=8, max_cpu_loras=8)
    assert cfg.bases["team"].model.endswith("examples/digit_team/models.py:base")


def test_a_rank_8_adapter_on_q_k_v_o_is_a_small_fraction_of_the_base():
    spec = import_job(str(ROOT / "examples" / "digit_team" / "models.py")).BASE
    h, kv, layers = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.num_layers
    base = layers * (2 * h * h + 2 * h * kv + 3 * h * spec.intermediate_size)  # attention + MLP, no embeddings
    adapter = layers * 8 * ((h + h) * 2 + (h + kv) * 2)  # r x (in + out) for q, o, k, v
    assert adapter / base < 0.03


def test_each_task_scores_the_fraction_of_right_positions():
    d = tasks.DIGIT_IDS
    query = [d[3], d[1], d[2]]
    assert tasks.reward("sorter", query, [d[1], d[2], d[3]]) == 1.0
    assert tasks.reward("reverser", query, [d[2], d[1], d[0]]) == 2 / 3
    assert tasks.reward("copier", query, query[:2]) == 0.0  # wrong length
    assert tasks.reward("maxer", query, [d[4]]) == 1.0  # the expansion 3 4 1 2 2 3 has max 4
    assert tasks.task_of("copier_b") == "copier"
