"""The fields a workflow reads are tried on the data before any worker starts: the episode
runs dry on the first row up to its first call that needs a worker; a field no row has is
one line then, and nothing else the workflow does in a dry run is an error there."""

import asyncio

import pytest

from flexmarl.controller.episodes.data import DataError, Dataset
from flexmarl.controller.episodes.dry_read import check_fields


@pytest.fixture
def data(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"question": "q0", "answer": 1}\n\n{"question": "q1"}\n')
    return Dataset.from_path(tmp_path / "rows.jsonl", seed=0, shuffle=False, name="data.train")


def test_a_field_no_row_has_read_before_the_first_agent_call_is_one_line_naming_it_and_where(data):
    async def episode(ctx):
        question, truth = ctx.item["question"], ctx.item["answr"]
        await ctx.chat("solver", [{"role": "user", "content": question}])

    with pytest.raises(DataError) as info:
        check_fields(episode, data, {"solver": None}, seed=0)
    message = str(info.value)
    assert message.startswith("data.train: no row has a field 'answr', which the workflow reads (at ")
    assert "test_dry_read.py:" in message and "the rows' fields: " in message and "\n" not in message


def test_a_field_read_in_the_first_agent_calls_arguments_is_read(data):
    async def episode(ctx):
        await ctx.generate("solver", ctx.item["prompt"])

    with pytest.raises(DataError, match="no row has a field 'prompt'"):
        check_fields(episode, data, {"solver": None}, seed=0)


def test_fields_some_rows_have_and_reads_after_the_first_agent_call_pass(data):
    seen = []

    async def episode(ctx):
        seen.append((ctx.item["question"], ctx.item.get("hint"), ctx.rng.random() < 1, sorted(ctx.agents)))
        answers = await ctx.generate("solver", "x")  # the dry run ends here
        seen.append(ctx.item["nowhere"])
        return answers

    check_fields(episode, data, {"solver": None, "judge": None}, seed=0)
    assert seen == [("q0", None, True, ["judge", "solver"])]


def test_anything_else_the_workflow_does_is_left_to_the_run(data):
    async def raises(ctx):
        raise ZeroDivisionError("its own bug: found with its traceback when episodes run")

    async def catches_everything(ctx):
        try:
            ctx.openai_client()
        except Exception:  # the dry run's end is not the workflow's to catch
            raise AssertionError("caught") from None

    async def gathers(ctx):
        await asyncio.gather(*(ctx.generate(a, "x") for a in ("solver", "judge")))

    async def waits(ctx):
        await asyncio.sleep(30)
        ctx.item["nowhere"]

    for episode in (raises, catches_everything, gathers, waits):  # the one that waits is left where it waits
        check_fields(episode, data, {"solver": None, "judge": None}, seed=0)


def test_a_missing_field_reached_inside_a_branch_is_found_too(data):
    async def branch(ctx, i):
        return ctx.item["answer_text"] if i else None

    async def episode(ctx):
        await asyncio.gather(*(branch(ctx, i) for i in range(2)))

    with pytest.raises(DataError, match="no row has a field 'answer_text'"):
        check_fields(episode, data, {}, seed=0)
