"""Model names -> directories: built-ins are found by their torch-free cache key and built,
on a miss, by the builder in a child process."""

import subprocess
from pathlib import Path

import pytest

from flexmarl.controller.run import model_resolution as models
from flexmarl.controller.run.model_resolution import ModelBuildError, ModelError, resolve_model
from flexmarl.controller.tasks import digit_chain
from flexmarl.runtime.model_specs import job_models


class FakeBuilder:
    """Stands in for subprocess.run in the resolver: records each start, answers `reply`
    (a CompletedProcess, or an exception to raise)."""

    def __init__(self):
        self.starts = []
        self.reply = None

    def __call__(self, command, **kwargs):
        self.starts.append(command)
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply


@pytest.fixture
def builder(monkeypatch):
    fake = FakeBuilder()
    monkeypatch.setattr(models.subprocess, "run", fake)
    return fake


def test_a_cached_built_in_model_is_returned_without_starting_a_process(tmp_path, builder):
    entry = tmp_path / job_models(digit_chain.__name__)["solver"].key()
    entry.mkdir()
    assert resolve_model("tiny:solver", tmp_path) == str(entry)
    assert builder.starts == []


def test_a_half_built_entry_is_not_taken_for_a_cached_model(tmp_path, builder):
    key = job_models(digit_chain.__name__)["solver"].key()
    (tmp_path / f".building-{key}-x1y2").mkdir()
    builder.reply = subprocess.CompletedProcess([], 0, "", "")
    with pytest.raises(ModelBuildError):
        resolve_model("tiny:solver", tmp_path)
    assert len(builder.starts) == 1


def test_a_builder_failure_names_the_model_and_quotes_the_end_of_its_output(tmp_path, builder):
    stderr = "\n".join(f"line {i}" for i in range(50)) + "\nOSError: [Errno 28] No space left on device"
    builder.reply = subprocess.CompletedProcess([], 1, "", stderr)
    with pytest.raises(ModelBuildError) as failure:
        resolve_model("tiny:checker", tmp_path)
    message = str(failure.value)
    assert "building the built-in model 'tiny:checker' failed (exit status 1)" in message
    assert "No space left on device" in message and "line 49" in message
    assert "line 10\n" not in message  # only the tail
    assert "-m flexmarl.workers.models --job flexmarl.controller.tasks.digit_chain --agent checker" in message


def test_a_builder_past_its_time_limit_is_a_clear_error(tmp_path, builder):
    builder.reply = subprocess.TimeoutExpired(["builder"], models.BUILD_TIMEOUT_S,
                                                     output=b"warming up\n", stderr=b"")
    with pytest.raises(ModelBuildError, match=r"'tiny:planner' did not finish within \d+ s(.|\n)*warming up"):
        resolve_model("tiny:planner", tmp_path)


@pytest.mark.slow
def test_a_miss_builds_the_model_in_a_child_process_and_then_it_is_cached(tmp_path, monkeypatch):
    real_run = subprocess.run
    starts = []

    def counting_run(command, **kwargs):
        starts.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(models.subprocess, "run", counting_run)
    built = Path(resolve_model("tiny:planner", tmp_path))
    assert len(starts) == 1 and starts[0][1:3] == ["-m", "flexmarl.workers.models"]
    assert built == tmp_path / job_models(digit_chain.__name__)["planner"].key()
    assert (built / "config.json").exists() and (built / "tokenizer.json").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [built.name]  # no staging left
    assert resolve_model("tiny:planner", tmp_path) == str(built)
    assert len(starts) == 1


def test_unknown_built_in_model_lists_the_known_ones(tmp_path, builder):
    with pytest.raises(ModelError, match="unknown built-in model 'tiny:plannr'.*tiny:planner, tiny:solver, "
                                       "tiny:checker"):
        resolve_model("tiny:plannr", tmp_path)
    assert builder.starts == []


def test_a_model_path_must_be_a_directory_with_a_config(tmp_path):
    with pytest.raises(ModelError, match="neither a built-in"):
        resolve_model(str(tmp_path / "nowhere"), tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "mine"), tmp_path) == str(tmp_path / "mine")


# ---- a user's job: tiny:JOB:AGENT ----------------------------------------------------

USER_JOB = """
from flexmarl.runtime.model_specs import SPECIAL_TOKENS, TinyModelRecipe, TinyModelSpec
from neighbour import SEED
TINY_MODELS = {name: TinyModelRecipe(TinyModelSpec(name, 64, 1, 2, 1, 64, seed=SEED), SPECIAL_TOKENS)
               for name in ("writer", "judge")}
"""


@pytest.fixture
def user_job(tmp_path, monkeypatch):
    """A job folder with models.py (importing a neighbour), named relative to the cwd."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "neighbour.py").write_text("SEED = 5\n")
    (tmp_path / "job" / "models.py").write_text(USER_JOB)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "job" / "models.py"


def test_a_users_job_file_names_its_cached_models_without_starting_a_process(user_job, tmp_path, builder):
    entry = tmp_path / "cache" / job_models(str(user_job))["judge"].key()
    entry.mkdir(parents=True)
    assert resolve_model("tiny:job/models.py:judge", tmp_path / "cache") == str(entry)
    assert builder.starts == []


def test_a_users_job_model_is_built_by_the_builder_given_the_absolute_job_file(user_job, tmp_path, builder):
    built = tmp_path / "cache" / "writer-built"
    built.mkdir(parents=True)
    builder.reply = subprocess.CompletedProcess([], 0, f"{built}\n", "")
    assert resolve_model("tiny:job/models.py:writer", tmp_path / "cache") == str(built)
    (command,) = builder.starts
    assert command[command.index("--job") + 1] == str(user_job.resolve())
    assert command[command.index("--agent") + 1] == "writer"


def test_a_dotted_job_module_names_its_models_too(tmp_path, builder):
    entry = tmp_path / job_models(digit_chain.__name__)["checker"].key()
    entry.mkdir()
    assert resolve_model("tiny:flexmarl.controller.tasks.digit_chain:checker", tmp_path) == str(entry)
    assert builder.starts == []


def test_an_unknown_agent_of_a_users_job_lists_the_jobs_models(user_job, tmp_path, builder):
    with pytest.raises(ModelError, match=r"'tiny:job/models.py:critic'.*tiny:job/models.py:writer, "
                                       r"tiny:job/models.py:judge"):
        resolve_model("tiny:job/models.py:critic", tmp_path)
    assert builder.starts == []


def test_a_job_file_that_is_missing_or_fails_to_import_is_a_clear_error(user_job, tmp_path, builder):
    with pytest.raises(ModelBuildError, match="job module .*nowhere.py' could not be read: FileNotFoundError"):
        resolve_model("tiny:job/nowhere.py:writer", tmp_path)
    (tmp_path / "job" / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(ModelBuildError, match="ModuleNotFoundError: No module named 'not_a_module_anywhere'"):
        resolve_model("tiny:job/broken.py:writer", tmp_path)
    assert builder.starts == []
