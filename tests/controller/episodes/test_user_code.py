"""A workflow from a module path or a file path; every bad path is a clear error."""

import sys

import pytest

from flexmarl.controller.episodes.user_code import WorkflowError, load_workflow
from flexmarl.controller.tasks import digit_chain

GOOD = """
import helper_mod

async def episode(ctx):
    return helper_mod.VALUE

def not_async(ctx):
    pass
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "helper_mod.py").write_text("VALUE = 42\n")
    (tmp_path / "my_flow.py").write_text(GOOD)
    pkg = tmp_path / "site" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "flows.py").write_text("async def episode(ctx):\n    return 'from a package'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith(("mypkg", "helper_mod", "flexmarl_workflow_my_flow"))]:
        del sys.modules[name]


def test_a_built_in_is_found_by_its_short_name():
    assert load_workflow("digit_chain") is digit_chain.episode


async def test_a_workflow_loads_from_a_module_path(user_dir):
    fn = load_workflow("mypkg.flows:episode")
    assert await fn(None) == "from a package"


async def test_a_workflow_loads_from_a_file_path_and_imports_its_neighbours(user_dir):
    fn = load_workflow(f"{user_dir}/my_flow.py:episode")
    assert await fn(None) == 42
    assert load_workflow(f"{user_dir}/my_flow.py:episode") is fn


@pytest.mark.parametrize("spec, message", [
    ("nonexistent_pkg.flows:episode", "no module named 'nonexistent_pkg'"),
    ("mypkg.flows:episod", "has no 'episod' (its async functions: episode)"),
    ("{dir}/missing.py:episode", "no file"),
    ("{dir}/my_flow.py:not_async", "must be declared `async def not_async(ctx)`"),
    ("no_such_builtin", "is not a built-in (digit_chain"),
])
def test_each_bad_workflow_path_gives_its_clear_error(user_dir, spec, message):
    with pytest.raises(WorkflowError) as info:
        load_workflow(spec.format(dir=user_dir))
    assert message in str(info.value)


def test_a_workflow_file_that_raises_on_import_names_the_file_and_the_error(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('missing API key')\n")
    with pytest.raises(WorkflowError, match="broken.py failed: RuntimeError: missing API key"):
        load_workflow(f"{tmp_path}/broken.py:episode")


async def test_a_bad_workflow_fails_the_experiment_before_any_worker_starts(tmp_path):
    from flexmarl.controller import Experiment
    from flexmarl.controller.tasks.digit_chain import default_config
    from flexmarl.runtime.config import load_config

    cfg = load_config(None, ["run.workflow='nope.flows:episode'", "run.progress=false"], defaults=default_config())
    exp = Experiment(cfg, run_dir=tmp_path)
    with pytest.raises(WorkflowError, match="no module named 'nope'"):
        async with exp:
            pass
    assert exp.local is None  # no worker process was started
