"""The rollout engine's adapter tests share their base model (tests/workers/rollout_engines.py)."""

import pytest
from rollout_engines import write_base


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A small randomly initialised Qwen2 base, written once per test module."""
    return write_base(tmp_path_factory.mktemp("base"))
