"""Bad configuration fails early, naming the culprit."""

import pytest

from flexmarl.controller import cli
from flexmarl.controller.episodes.user_code import WorkflowError, load_workflow
from flexmarl.controller.run.model_resolution import ModelError, resolve_model
from flexmarl.controller.state.decisions import place_agents


def test_unknown_built_in_model_is_named(tmp_path):
    with pytest.raises(ModelError, match="unknown built-in model 'tiny:plannr'.*tiny:planner"):
        resolve_model("tiny:plannr", tmp_path)


def test_a_model_path_without_a_config_is_named(tmp_path):
    with pytest.raises(ModelError, match="neither a built-in"):
        resolve_model(str(tmp_path / "nowhere"), tmp_path)


def test_unknown_workflow_is_named():
    with pytest.raises(WorkflowError, match="'chain' is not a built-in \\(digit_chain"):
        load_workflow("chain")


def test_more_agents_than_rollout_workers_is_refused():
    with pytest.raises(ValueError, match="3 agents need at least 3 rollout workers"):
        place_agents(["a", "b", "c"], ["r0", "r1"], {"a": 1, "b": 1, "c": 1})


def test_the_cli_names_a_mistyped_key_and_exits(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--set", "pipeline.mdoe=async"])
    assert "unknown key 'pipeline.mdoe'" in str(exit_info.value.code)


def test_an_unknown_initial_placement_is_named():
    from flexmarl.runtime.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="router.placement must be 'chain' or 'parallel', got 'even'"):
        load_config(None, ["router.placement='even'"])
