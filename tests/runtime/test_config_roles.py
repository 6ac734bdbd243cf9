"""Frozen agents, snapshots, teachers and dynamic sampling in the config: what each key
means once loaded, and each mistake refused at start in one line naming the key."""

import pytest

from flexmarl.runtime import protocol as p
from flexmarl.runtime.config import ConfigError, dump_toml, load_config, trained_agents

TWO = ["agents.player.model=\"tiny:solver\"", "agents.judge.model=\"tiny:checker\""]


def load(*overrides):
    return load_config(None, [*TWO, *overrides])


def test_a_frozen_agent_and_a_snapshot_are_served_but_not_trained():
    cfg = load("agents.judge.train=false", "agents.past.snapshot_of=\"player\"", "agents.past.snapshot_every=5")
    assert cfg.agents["judge"].frozen and cfg.agents["past"].frozen and not cfg.agents["player"].frozen
    assert trained_agents(cfg) == ["player"]
    past = cfg.agents["past"]
    assert past.model == cfg.agents["player"].model and past.snapshot_every == 5  # it takes the model it copies


def test_a_snapshot_of_an_adapter_agent_is_one_more_adapter_of_its_base():
    cfg = load_config(None, ["bases.b.model=\"tiny:solver\"", "agents.a.base=\"b\"", "agents.a.lora_rank=16",
                             "agents.s.snapshot_of=\"a\""])
    s = cfg.agents["s"]
    assert (s.base, s.model, s.lora_rank) == ("b", "", 16)
    from flexmarl.runtime.config import required_slots
    assert required_slots(cfg, "b").max_loras == 2  # a slot for the snapshot beside its source


def test_a_resolved_config_with_a_snapshot_loads_back_unchanged(tmp_path):
    cfg = load("agents.past.snapshot_of=\"player\"", "agents.player.teacher=\"judge\"", "agents.judge.train=false")
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg))
    again = load_config(path)
    assert again.agents == cfg.agents


def test_a_teacher_and_decoupled_ppo_reach_the_trainer_as_loss_options():
    cfg = load("agents.player.teacher=\"judge\"", "agents.player.teacher_coef=0.5", "agents.player.teacher_only=true",
               "agents.player.off_policy=\"decoupled\"", "agents.player.behav_weight_cap=3.0",
               "agents.player.teacher_kl_cap=2.5")
    options = cfg.agents["player"].loss_options()
    assert (options.teacher_coef, options.teacher_only, options.teacher_kl_cap) == (0.5, True, 2.5)
    assert (options.off_policy, options.behav_weight_cap) == ("decoupled", 3.0)
    assert cfg.agents["judge"].loss_options().teacher_coef == 0.0  # no teacher: no term
    assert options.teacher_top_k == 0
    assert load("agents.player.teacher=\"judge\"", "agents.player.teacher_top_k=18").agents["player"] \
        .loss_options().teacher_top_k == 18


def test_the_bound_on_extra_episodes_defaults_to_three_batches():
    assert load().pipeline.extra_episodes() == 3 * load().pipeline.queries_per_step
    assert load("pipeline.max_extra_episodes=5").pipeline.extra_episodes() == 5


@pytest.mark.parametrize("overrides, error", [
    (["agents.player.teacher=\"nobody\""], r"agents.player.teacher = 'nobody': no \[agents.nobody\] is declared"),
    (["agents.player.teacher=\"player\""], r"agents.player.teacher = 'player': an agent cannot teach itself"),
    (["agents.player.teacher=\"judge\"", "agents.judge.teacher=\"player\""],
     r"agents.player.teacher: the teachers form a cycle \(player -> judge -> player\)"),
    (["agents.player.teacher=\"judge\"", "agents.player.teacher_coef=0.0"], r"teacher_coef must be > 0"),
    (["agents.player.teacher=\"judge\"", "agents.player.teacher_kl_cap=-1"], r"teacher_kl_cap must be >= 0"),
    (["agents.player.teacher_top_k=4"], r"agents.player.teacher_top_k = 4 needs a teacher"),
    (["agents.player.teacher=\"judge\"", "agents.player.teacher_top_k=21"],
     r"agents.player.teacher_top_k = 21: must be 0 .* to 20 \(the rollout engine's max_logprobs\)"),
    (["agents.player.teacher=\"judge\"", "agents.player.teacher_top_k=-1"], r"teacher_top_k = -1: must be 0"),
    (["agents.player.teacher=\"judge\"", "agents.player.teacher_top_k=4", "agents.player.teacher_kl_cap=1"],
     r"agents.player.teacher_kl_cap clips the sampled token's reverse KL, which teacher_top_k = 4 replaces"),
    (["agents.judge.train=false", "agents.past.snapshot_of=\"judge\""],
     r"agents.past.snapshot_of = 'judge', a frozen agent"),
    (["agents.past.snapshot_of=\"nobody\""], r"agents.past.snapshot_of = 'nobody': no \[agents.nobody\]"),
    (["agents.past.snapshot_of=\"past\""], r"cannot be a snapshot of itself"),
    (["agents.past.snapshot_of=\"player\"", "agents.past.snapshot_every=0"], r"snapshot_every must be >= 1"),
    (["agents.past.snapshot_of=\"player\"", "agents.past.model=\"tiny:planner\""],
     r"agents.past.model is set, but agents.past is a snapshot of agents.player"),
    (["agents.judge.train=false", "agents.judge.dynamic_sampling=true"],
     r"agents.judge.dynamic_sampling is set, but agents.judge is frozen \(train = false\)"),
    (["agents.judge.train=false", "agents.judge.teacher=\"player\""], r"agents.judge.teacher is set, but .* frozen"),
    (["agents.judge.train=false", "agents.player.train=false"], r"every agent is frozen"),
    (["agents.player.off_policy=\"decoupled\"", "agents.player.behav_weight_cap=1.0"], r"behav_weight_cap must be > 1"),
    (["pipeline.max_extra_episodes=-1"], r"pipeline.max_extra_episodes must be >= 0"),
    (["agents.judge.adapter=\"/x\""], r"agents.judge.adapter is for a frozen adapter agent"),
])
def test_each_mistake_is_refused_in_one_line_naming_the_key(overrides, error):
    with pytest.raises(ConfigError, match=error) as caught:
        load(*overrides)
    assert "\n" not in str(caught.value)


def test_a_frozen_adapter_agent_needs_its_adapter_directory():
    with pytest.raises(ConfigError, match=r"agents.j is a frozen adapter of bases.b without its adapter"):
        load_config(None, ["bases.b.model=\"tiny:solver\"", "agents.a.base=\"b\"", "agents.j.base=\"b\"",
                           "agents.j.train=false"])


def test_the_wire_carries_the_new_options():
    assert "decoupled" in p.OffPolicyCorrection.__args__
    assert p.LossOptions().teacher_coef == 0.0 and p.LossOptions().behav_weight_cap == 5.0
