"""The wiring root: what `resolve` checks and loads, and that `build` makes every
component of a run at once, wired to one another, with nothing left to fill in later."""

import dataclasses
import typing
from types import SimpleNamespace

import pytest

from flexmarl.controller.run import components
from flexmarl.controller.run.components import Components, Given, Resolved, build, resolve
from flexmarl.controller.state import decisions
from flexmarl.controller.tasks.digit_chain import default_config
from flexmarl.runtime import bases, protocol
from flexmarl.runtime.config import load_config


@pytest.fixture
def models_named(monkeypatch):
    """Model names resolved to directories named after them, without building anything."""
    monkeypatch.setattr(components, "resolve_model", lambda name, *_: f"/models/{name.replace(':', '-')}")
    monkeypatch.setattr(components, "has_tokenizer", lambda path: False)


def built(tmp_path, *overrides):
    cfg = load_config(None, ["run.progress=false", *overrides], defaults=default_config())
    server = SimpleNamespace(on_died=[], on_joined=[], closing=False, next_request_id=lambda: 7)
    parts = build(cfg, resolve(cfg), Given(server, tmp_path, emit=lambda e: None, flush_events=None))
    return cfg, parts


def close(parts: Components) -> None:
    parts.metrics.close()
    parts.tools.shutdown()


def test_build_sets_every_component_to_its_declared_type(tmp_path, models_named):
    cfg, parts = built(tmp_path)
    hints = typing.get_type_hints(Components)
    for field in dataclasses.fields(Components):
        value, kind = getattr(parts, field.name), hints[field.name]
        if field.name == "endpoint":  # made only with openai.enabled
            assert value is None and not cfg.openai.enabled
        elif typing.get_origin(kind) is dict:
            assert list(value) == list(cfg.agents)
            assert all(isinstance(v, typing.get_args(kind)[1]) for v in value.values())
        elif typing.get_origin(kind) in (typing.Callable, __import__("collections.abc").abc.Callable):
            assert callable(value), field.name
        else:
            assert isinstance(value, kind), (field.name, value)
    close(parts)


def test_components_are_frozen(tmp_path, models_named):
    _, parts = built(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.allocator = None
    close(parts)


def test_the_components_share_one_of_each_piece_of_state(tmp_path, models_named):
    cfg, parts = built(tmp_path, "router.across_agents=true")
    assert parts.schedule.versions is parts.versions and parts.weights.versions is parts.versions
    assert parts.rejoin.instances is parts.instances and parts.client.owner is parts.instances
    assert parts.rebalancer.instances is parts.instances and parts.admission.weights is parts.weights
    assert all(pl.allocator is parts.allocator and pl.store is parts.store for pl in parts.pipelines.values())
    # the allocator weighs each agent's work as its pipeline reports it
    assert all(parts.allocator.work(a) == parts.pipelines[a].work() for a in cfg.agents)
    assert parts.allocator.trainers == []  # the registered trainers join at set-up
    close(parts)


def test_an_engine_starts_on_its_units_model_at_version_zero(tmp_path, models_named):
    _, parts = built(tmp_path)
    message = parts.load_message("solver")
    assert isinstance(message, protocol.LoadModel)
    assert (message.request_id, message.agent, message.model_path, message.version) == (
        7, "solver", "/models/tiny-solver", 0)
    close(parts)


def test_resolve_names_a_model_that_names_nothing_before_building_anything(tmp_path, models_named):
    cfg = load_config(None, ["run.progress=false", f"agents.solver.model='{tmp_path}/none'"],
                      defaults=default_config())
    with pytest.raises(Exception, match="no such directory"):
        resolve(cfg)


def test_resolved_models_and_units_cover_every_agent(models_named):
    cfg = load_config(None, ["run.progress=false"], defaults=default_config())
    resolved = resolve(cfg)
    assert isinstance(resolved, Resolved) and resolved.dataset is None and resolved.tokenizers == {}
    assert resolved.model_path == {a: f"/models/tiny-{a}" for a in cfg.agents}
    assert [resolved.units.of(a).name for a in cfg.agents] == list(cfg.agents)


def test_units_look_an_agent_up_by_its_unit_and_lora_shape():
    lora = protocol.LoraSettings(8)
    units = bases.Units({"w": bases.EngineUnit("w", ("w",)),
                         "bases.b": bases.EngineUnit("bases.b", ("x", "y"), lora=True)}, {"x": lora, "y": lora})
    assert list(units) == ["w", "bases.b"] and len(units) == 2
    assert units.of("y") is units["bases.b"] and units.of("w").name == "w"
    assert units.lora("x") is lora and units.lora("w") is None


def test_the_demand_rule_weighs_group_size_output_length_and_config_position():
    cfg = load_config(None, [], defaults=default_config())
    # planner 4 x 3 x 1, solver 4 x 6 x 2, checker 2 x 1 x 3: what the driver computed inline before
    assert {a: decisions.expected_tokens(cfg.agents, a) for a in cfg.agents} == {
        "planner": 12, "solver": 48, "checker": 6}
    weights = decisions.unit_weights(bases.engine_units(cfg), lambda a: decisions.expected_tokens(cfg.agents, a))
    assert decisions.place_agents(list(weights), [f"r{i}" for i in range(6)], weights) == {
        "planner": ["r0"], "solver": ["r1", "r3", "r4", "r5"], "checker": ["r2"]}
    # router.placement = "parallel": every agent asked alike, by group size x output length alone
    parallel = decisions.unit_weights(bases.engine_units(cfg), lambda a: decisions.PLACEMENT_DEMAND["parallel"](
        cfg.agents, a))
    assert parallel == {"planner": 12, "solver": 24, "checker": 2}
    assert decisions.place_agents(list(parallel), [f"r{i}" for i in range(6)], parallel) == {
        "planner": ["r0", "r5"], "solver": ["r1", "r3", "r4"], "checker": ["r2"]}
    assert decisions.PLACEMENT_DEMAND["chain"] is decisions.expected_tokens  # the default's rule
    equal = decisions.unit_weights(bases.engine_units(cfg), lambda a: decisions.equal_demand(cfg.agents, a))
    assert decisions.place_agents(list(equal), [f"r{i}" for i in range(6)], equal) == {
        "planner": ["r0", "r4"], "solver": ["r1", "r3"], "checker": ["r2", "r5"]}  # ties: the later name


def test_a_field_the_workflow_reads_and_no_row_has_fails_before_any_model_is_built(tmp_path, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a model was resolved before the data's fields were checked")

    monkeypatch.setattr(components, "resolve_model", no_build)
    (tmp_path / "flow.py").write_text("async def episode(ctx):\n    q, a = ctx.item['question'], ctx.item['answer']\n"
                                      "    await ctx.generate('solver', q)\n")
    (tmp_path / "train.jsonl").write_text('{"question": "What is 2 + 3?", "truth": "5"}\n')
    cfg = load_config(None, ["run.progress=false", f"run.workflow='{tmp_path}/flow.py:episode'",
                             f"data.train='{tmp_path}/train.jsonl'", "agents.solver.model='tiny:solver'"])
    with pytest.raises(components.DataError, match=r"^data.train: no row has a field 'answer', which the workflow "
                                                   r"reads \(at .*flow.py:2 in episode\); the rows' fields: "):
        resolve(cfg, tmp_path / "run")


TEAM = components.Path(__file__).resolve().parents[3] / "examples" / "digit_team" / "models.py"


def test_a_base_is_resolved_once_under_its_own_name_and_kept_in_the_run_directory(tmp_path, monkeypatch, caplog):
    """A base built from a recipe is resolved once for all its agents (its build shown
    under the base's name) and kept as RUN_DIR/bases/NAME, which its agents load; a run
    that keeps it already uses it without resolving its recipe again."""
    cache_entry = tmp_path / "cache" / "team_base-0123"
    cache_entry.mkdir(parents=True)
    (cache_entry / "config.json").write_text("{}")
    (cache_entry / "model.safetensors").write_bytes(b"weights")
    labels, resolved_names = [], []

    def resolve_model(name, cache_root, on_build):
        resolved_names.append(name)
        with on_build(name) as stage:  # as a build on a miss shows itself
            labels.append(stage.description)
        return str(cache_entry)

    monkeypatch.setattr(components, "resolve_model", resolve_model)
    monkeypatch.setattr(components, "has_tokenizer", lambda path: False)
    cfg = load_config(None, ["run.progress=false", f"bases.team.model='tiny:{TEAM}:base'", "agents.sorter.base='team'",
                             "agents.copier.base='team'"])
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="flexmarl.components"):
        paths = resolve(cfg, run_dir).model_path
    kept = run_dir.absolute() / "bases" / "team"
    assert paths == {"sorter": str(kept), "copier": str(kept)} and resolved_names == [f"tiny:{TEAM}:base"]
    assert labels[0].startswith(f"building model tiny:{TEAM}:base for base team (agents sorter, copier)")
    assert (kept / "model.safetensors").read_bytes() == b"weights"
    assert (kept / "model.safetensors").stat().st_ino == (cache_entry / "model.safetensors").stat().st_ino  # a link
    assert f"model of base team (agents sorter, copier): {kept}" in caplog.text

    resolved_names.clear()
    cfg = load_config(None, ["run.progress=false", "bases.team.model='tiny:/gone/models.py:base'",
                             "agents.sorter.base='team'", "agents.copier.base='team'"])
    assert resolve(cfg, run_dir).model_path == paths and resolved_names == []  # the recipe may be gone


def test_a_teacher_whose_tokenizer_differs_from_its_students_is_refused_in_one_line():
    """The digit chain's models share one vocabulary; the review chain's verifier has a BPE
    tokenizer of its own (both built once and cached)."""
    from pathlib import Path

    from flexmarl.runtime.config import ConfigError

    review = Path(__file__).parents[3] / "examples" / "review_chain" / "models.py"
    ok = load_config(None, ["run.progress=false", "agents.planner.teacher=\"solver\""], defaults=default_config())
    components._check_teachers(ok, *_paths_and_tokenizers(ok))
    bad = load_config(None, ["run.progress=false", "agents.planner.teacher=\"verifier\"",
                             f"agents.verifier.model=\"tiny:{review}:verifier\""], defaults=default_config())
    with pytest.raises(ConfigError, match=r"agents.planner.teacher = 'verifier', whose tokenizer differs from "
                                          r"planner's \(vocabulary: \d+ against \d+\)") as caught:
        components._check_teachers(bad, *_paths_and_tokenizers(bad))
    assert "\n" not in str(caught.value)


def _paths_and_tokenizers(cfg):
    paths = components._model_paths(cfg, {}, None)
    return paths, components._tokenizers(cfg, paths)


def test_frozen_agents_and_snapshots_get_no_pipeline_allocator_entry_or_checkpoint_part(tmp_path, models_named,
                                                                                       monkeypatch):
    monkeypatch.setattr(components, "_check_teachers", lambda *args: None)  # no model files here
    cfg, parts = built(tmp_path, "agents.checker.train=false", "agents.past.snapshot_of='planner'",
                       "agents.solver.dynamic_sampling=true", "agents.solver.teacher='checker'")
    assert set(parts.pipelines) == set(parts.allocator.specs.config) == {"planner", "solver"}
    assert parts.checkpoints.agents == ["planner", "solver"] and parts.schedule.agents == ["planner", "solver"]
    assert parts.schedule.snapshots == {"past": 1} and parts.weights.snapshots == {"past": ("planner", 1)}
    assert parts.store.frozen == {"checker", "past"} and parts.store.dynamic == {"solver"}
    assert parts.store.teacher_of("solver") == "checker" and parts.store.teacher_of("planner") == ""
    assert set(parts.resolved.units) == {"planner", "solver", "checker", "past"}  # every agent is served
    close(parts)
