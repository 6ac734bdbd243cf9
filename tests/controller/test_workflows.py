from flexmarl.controller.workflows import default_config
from flexmarl.runtime.config import load_config


def test_example_preset_is_the_embedded_default():
    assert load_config("examples/default.toml") == load_config(None, defaults=default_config())
