"""Datasets: jsonl, parquet and save_to_disk rows reach ctx.item in the configured order."""

import asyncio
import json

import pytest

from flexmarl.controller.data import DataError, DataOrder, Dataset, load_rows
from flexmarl.controller.episodes import EpisodeProducer
from flexmarl.controller.schedule import BatchSchedule
from flexmarl.controller.store import ExperienceStore
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
