"""An adapter agent's target modules are checked against its base's module names (read
from the safetensors headers, or from a tiny model's recipe) before anything builds or
loads the base: a name the base lacks is one line naming the key, the name and the
modules the base has."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flexmarl.controller.run.components import resolve
from flexmarl.controller.run.lora_targets import check_lora_targets, model_tensor_names, unknown_targets
from flexmarl.runtime.config import ConfigError, load_config

LLAMA = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"]


def a_base(folder, names=LLAMA, sharded=False):
    folder.mkdir(parents=True)
    tensors = {n: torch.zeros(2) for n in names}
    if sharded:
        save_file(dict(list(tensors.items())[:3]), str(folder / "model-00001-of-00002.safetensors"))
        save_file(dict(list(tensors.items())[3:]), str(folder / "model-00002-of-00002.safetensors"))
        weight_map = {n: f"model-0000{1 + (i >= 3)}-of-00002.safetensors" for i, n in enumerate(names)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("sharded", [False, True])
def test_the_bases_tensor_names_come_from_the_weights_headers(tmp_path, sharded):
    assert sorted(model_tensor_names(a_base(tmp_path / "base", sharded=sharded))) == sorted(LLAMA)


def test_a_target_matches_a_module_by_its_name_or_its_last_parts():
    assert unknown_targets(["q_proj", "self_attn.k_proj", "mlp.up_proj"], LLAMA) == []
    assert unknown_targets(["c_attn", "q_pro", "proj"], LLAMA) == ["c_attn", "q_pro", "proj"]


def test_a_target_the_base_lacks_is_one_line_naming_the_key_and_what_the_base_has(tmp_path):
    base = a_base(tmp_path / "base")
    check_lora_targets("solver", ["q_proj", "k_proj"], str(base), model_tensor_names(base))  # fine
    with pytest.raises(ConfigError) as info:
        check_lora_targets("solver", ["q_proj", "c_attn"], str(base), model_tensor_names(base))
    assert str(info.value) == (f"agents.solver.lora_target_modules: 'c_attn' names no module of its base {base} "
                               "(the base's modules end in: embed_tokens, input_layernorm, k_proj, lm_head, q_proj, "
                               "up_proj); name modules it has")


def test_a_base_in_another_format_is_left_to_the_trainer(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "pytorch_model.bin").write_bytes(b"\0" * 16)
    assert model_tensor_names(tmp_path / "base") is None
    check_lora_targets("solver", ["c_attn"], str(tmp_path / "base"), None)


def test_a_job_with_a_wrong_target_is_refused_before_any_worker_starts(tmp_path):
    from flexmarl.controller.run.training import TrainingRun
    from flexmarl.runtime.config import load_config

    base = a_base(tmp_path / "base")
    (base / "config.json").write_text("{}")
    cfg = load_config(None, ["run.progress=false", f"bases.b.model={str(base)!r}", "agents.a.base='b'",
                             "agents.a.lora_target_modules=['q_proj', 'qkv']"])
    with pytest.raises(ConfigError, match="agents.a.lora_target_modules: 'qkv' names no module of its base"):
        TrainingRun(cfg, server=None, run_dir=tmp_path / "run", emit=lambda e: None, flush_events=None,
                    worker_ids=lambda role: [])


def test_a_recipes_module_names_are_known_without_building_it_and_are_the_built_models(tmp_path, monkeypatch):
    """A tiny base's targets are checked against its recipe's shape; the names the recipe
    gives are the ones the built model's weights carry (the digit chain's solver, built
    or found in the model cache)."""
    from flexmarl.controller.run import model_resolution
    from flexmarl.controller.run.model_resolution import resolve_model, tensor_names
    from flexmarl.controller.tasks import digit_chain

    built = resolve_model("tiny:solver")
    assert sorted(tensor_names("tiny:solver")) == sorted(model_tensor_names(built))
    assert len(tensor_names("tiny:solver")) == 3 + 9 * digit_chain.TINY_MODELS["solver"].spec.num_layers

    def no_build(*args, **kwargs):
        raise AssertionError("the base was built before its targets were checked")

    monkeypatch.setattr(model_resolution, "_build_in_child", no_build)
    team = Path(__file__).resolve().parents[3] / "examples" / "digit_team" / "models.py"
    cfg = load_config(None, ["run.progress=false", f"bases.b.model='tiny:{team}:base'", "agents.a.base='b'",
                             "agents.a.lora_target_modules=['q_proj', 'c_attn']"])
    with pytest.raises(ConfigError, match=r"agents.a.lora_target_modules: 'c_attn' names no module of its base "
                                          r"tiny:.*models.py:base \(the base's modules end in: .*q_proj"):
        resolve(cfg, tmp_path / "run")
