"""An adapter agent's target modules are checked against its base's module names (read
from the safetensors headers) before anything loads the base: a name the base lacks is
one line naming the key, the name and the modules the base has."""

import json

import pytest
import torch
from safetensors.torch import save_file

from flexmarl.controller.run.lora_targets import check_lora_targets, tensor_names, unknown_targets
from flexmarl.runtime.config import ConfigError

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
    assert sorted(tensor_names(a_base(tmp_path / "base", sharded=sharded))) == sorted(LLAMA)


def test_a_target_matches_a_module_by_its_name_or_its_last_parts():
    assert unknown_targets(["q_proj", "self_attn.k_proj", "mlp.up_proj"], LLAMA) == []
    assert unknown_targets(["c_attn", "q_pro", "proj"], LLAMA) == ["c_attn", "q_pro", "proj"]


def test_a_target_the_base_lacks_is_one_line_naming_the_key_and_what_the_base_has(tmp_path):
    base = a_base(tmp_path / "base")
    check_lora_targets("solver", ["q_proj", "k_proj"], base)  # fine
    with pytest.raises(ConfigError) as info:
        check_lora_targets("solver", ["q_proj", "c_attn"], base)
    assert str(info.value) == (f"agents.solver.lora_target_modules: 'c_attn' names no module of its base {base} "
                               "(the base's modules end in: embed_tokens, input_layernorm, k_proj, lm_head, q_proj, "
                               "up_proj); name modules it has")


def test_a_base_in_another_format_is_left_to_the_trainer(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "pytorch_model.bin").write_bytes(b"\0" * 16)
    check_lora_targets("solver", ["c_attn"], tmp_path / "base")


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
