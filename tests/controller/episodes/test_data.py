"""Datasets: jsonl, parquet and save_to_disk rows reach ctx.item in the configured order."""

import asyncio
import json

import pytest

from flexmarl.controller.episodes.data import DataError, DataOrder, Dataset, load_rows
from flexmarl.controller.episodes.producer import EpisodeProducer
from flexmarl.controller.state.schedule import BatchSchedule
from flexmarl.controller.state.store import ExperienceStore
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config

ROWS = [{"question": f"q{i}", "answer": i} for i in range(5)]


def write_jsonl(path):
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_jsonl_parquet_and_save_to_disk_give_the_same_rows(tmp_path):
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    assert load_rows(write_jsonl(tmp_path / "rows.jsonl")) == ROWS
    assert load_rows(tmp_path / "rows.parquet") == ROWS
    assert load_rows(tmp_path / "saved") == ROWS


@pytest.mark.parametrize("name, content, message", [
    ("rows.txt", "hello", "unknown dataset format '.txt'"),
    ("missing.jsonl", None, "does not exist"),
    ("empty.jsonl", "", "has no rows"),
])
def test_bad_datasets_are_clear_errors(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message):
        load_rows(tmp_path / name)


def test_the_order_is_a_per_epoch_shuffle_from_the_seed_and_every_row_comes_once_per_epoch():
    order = DataOrder(5, seed=4, shuffle=True)
    first = [order.position(g).index for g in range(5)]
    second = [order.position(g).index for g in range(5, 10)]
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    assert [DataOrder(5, seed=4).position(g).index for g in range(5)] == first
    assert [DataOrder(5, seed=3, shuffle=False).position(g).index for g in range(7)] == [0, 1, 2, 3, 4, 0, 1]


def test_a_run_longer_than_the_data_allows_is_refused_up_front(tmp_path):
    data = Dataset.from_path(write_jsonl(tmp_path / "rows.jsonl"), seed=0, epochs=2)
    data.check_serves(10, "the run")
    with pytest.raises(DataError, match="needs 11 episodes but the data serves 10"):
        data.check_serves(11, "the run")


async def test_rows_reach_ctx_item_in_the_configured_order_and_the_log_records_them(tmp_path):
    cfg = load_config(None, ["run.steps=2", "pipeline.queries_per_step=3", "pipeline.max_concurrent_episodes=1",
                             "agents.a.model='m'"])
    data = Dataset.from_path(write_jsonl(tmp_path / "rows.jsonl"), seed=cfg.run.seed, shuffle=True)
    seen, events = [], []

    async def episode(ctx):
        seen.append(ctx.item["question"])

    schedule = BatchSchedule(["a"], 2, 3, overlap=True, max_staleness=0)
    producer = EpisodeProducer(cfg, episode, ExperienceStore(["a"]), None, schedule, events.append, data)
    await asyncio.wait_for(producer.run(), 5)
    expected = [ROWS[data.position(g).index]["question"] for g in range(6)]
    assert seen == expected and sorted(seen[:5]) == [r["question"] for r in ROWS]
    started = [e for e in events if isinstance(e, ev.BatchStarted)]
    assert [(e.batch, e.first_episode) for e in started] == [(1, 0), (2, 3)]
    assert [ROWS[i]["question"] for e in started for i in e.data_rows] == expected


def test_each_row_keeps_its_own_keys_whatever_the_format(tmp_path):
    import datasets

    rows = [{"question": "q0", "answer": 0}, {"question": "q1"}, {"question": "q2", "answer": None}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_rows(tmp_path / "rows.jsonl") == rows  # as written: a null stays, an absent key stays absent
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert load_rows(tmp_path / "rows.json") == rows
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    (tmp_path / "rows.csv").write_text("question,answer\nq0,0\nq1,\n")
    # a table has every column in every row: an empty cell is left out of its row
    assert load_rows(tmp_path / "rows.parquet") == [{"question": "q0", "answer": 0}, {"question": "q1"},
                                                    {"question": "q2"}]
    assert load_rows(tmp_path / "rows.csv") == [{"question": "q0", "answer": 0}, {"question": "q1"}]


def test_a_missing_key_names_the_row_and_its_keys_and_a_key_no_row_has_stops_the_run(tmp_path):
    from flexmarl.controller.episodes.data import MissingColumn, MissingField
    from flexmarl.controller.state.failures import RunFailed

    (tmp_path / "rows.jsonl").write_text('{"question": "q0", "answer": 1}\n{"question": "q1"}\n')
    data = Dataset.from_path(tmp_path / "rows.jsonl", seed=0, shuffle=False, name="data.train")
    assert data.item(0)["answer"] == 1 and data.item(1).get("answer") is None
    with pytest.raises(MissingField) as info:
        data.item(1)["answer"]
    assert str(info.value) == "data.train line 2 has no field 'answer' (its fields: 'question')"  # as the file counts
    assert isinstance(info.value, KeyError) and not isinstance(info.value, RunFailed)  # this episode's failure
    with pytest.raises(MissingColumn) as info:
        data.item(0)["prompt"]
    assert isinstance(info.value, RunFailed) and isinstance(info.value, KeyError)
    message = str(info.value)
    assert message.startswith("data.train: no row has a field 'prompt', which the workflow reads (at ")
    assert "test_data.py" in message and "the rows' fields: " in message and "\n" not in message


async def test_an_episode_reading_a_field_its_row_lacks_fails_alone_and_one_no_row_has_stops_the_run(tmp_path):
    from flexmarl.controller.episodes.data import MissingColumn

    cfg = load_config(None, ["run.steps=1", "pipeline.queries_per_step=2", "pipeline.max_concurrent_episodes=1",
                             "pipeline.max_failed_share=1.0", "agents.a.model='m'"])
    (tmp_path / "rows.jsonl").write_text('{"question": "q0", "answer": 1}\n{"question": "q1"}\n')
    data = Dataset.from_path(tmp_path / "rows.jsonl", seed=0, shuffle=False, name="data.train")
    answers = []

    async def episode(ctx):
        answers.append(ctx.item["answer"])

    schedule = BatchSchedule(["a"], 1, 2, overlap=True, max_staleness=0)
    producer = EpisodeProducer(cfg, episode, ExperienceStore(["a"]), None, schedule, lambda e: None, data)
    await asyncio.wait_for(producer.run(), 5)
    assert answers == [1] and producer.failed == 1
    assert "data.train line 2 has no field 'answer' (its fields: 'question')" in schedule.batches[1].first_failure

    async def typo(ctx):
        ctx.item["answr"]

    schedule = BatchSchedule(["a"], 1, 2, overlap=True, max_staleness=0)
    producer = EpisodeProducer(cfg, typo, ExperienceStore(["a"]), None, schedule, lambda e: None, data)
    with pytest.raises(MissingColumn, match="no row has a field 'answr'"):
        await asyncio.wait_for(producer.run(), 5)
