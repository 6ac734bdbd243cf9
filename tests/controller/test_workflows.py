from flexmarl.controller import digit_chain
from flexmarl.controller.digit_chain import default_config
from flexmarl.controller.user_code import load_workflow
from flexmarl.runtime.config import load_config


def test_example_preset_is_the_embedded_default():
    assert load_config("examples/default.toml") == load_config(None, defaults=default_config())


def test_the_built_in_digit_chain_workflow_is_the_job_module_episode():
    assert load_workflow("digit_chain") is digit_chain.episode
