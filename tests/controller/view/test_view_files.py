"""controller/view/files.py and watch.py: a run's files followed as they grow, and as they
start over under the reader."""

import json
import os

from flexmarl.controller.view.files import EventTail, LineTail
from flexmarl.controller.view.watch import RunWatch
from flexmarl.runtime import events as ev
from flexmarl.runtime.atomic import write_text_atomically
from flexmarl.runtime.eventlog import EventLog


def test_a_line_tail_returns_whole_lines_once_and_skips_what_is_not_a_json_object(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = LineTail(path)
    assert tail.poll() == (False, [])  # no file yet
    path.write_text('{"step": 1}\n[1, 2]\n{"step": 2, "loss": NaN}\nnot json\n{"step": 3, "tor')
    replaced, rows = tail.poll()
    assert not replaced and [r["step"] for _, r in rows] == [1, 2] and tail.bad_lines == 2
    assert rows[1][1]["loss"] != rows[1][1]["loss"]  # NaN, as Python's json writes it
    with open(path, "a") as fh:
        fh.write('n": 1}\n')
    assert [r for _, r in tail.poll()[1]] == [{"step": 3, "torn": 1}]
    offset = rows[1][0]
    assert tail.read_at(offset)["step"] == 2
    assert tail.poll() == (False, [])


def test_a_line_tail_reads_a_long_file_in_slices_and_a_line_longer_than_a_slice_whole(tmp_path):
    path = tmp_path / "samples.jsonl"
    lines = [{"i": i, "text": "x" * (i * 37 % 300)} for i in range(200)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    tail, seen = LineTail(path), []
    while rows := tail.poll(max_bytes=100)[1]:
        seen += [r for _, r in rows]
    assert seen == lines


def test_a_file_written_anew_in_place_of_the_one_read_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    tail = LineTail(path)
    assert len(tail.poll()[1]) == 3
    write_text_atomically(path, '{"step": 1}\n{"step": 2}\n')  # a resume cuts it back to its checkpoint
    replaced, rows = tail.poll()
    assert replaced and [r["step"] for _, r in rows] == [1, 2]
    with open(path, "w") as fh:  # a new run in the same directory, the same file truncated
        fh.write('{"step": 9, "run": "new"}\n' * 5)
    replaced, rows = tail.poll()
    assert replaced and [r["step"] for _, r in rows] == [9] * 5


async def test_an_event_tail_starts_over_when_a_new_run_replaces_the_log(tmp_path):
    path = tmp_path / "events.log"
    log = EventLog(path)
    for i in range(5):
        log.emit(ev.WorkerDied(f"w{i}", "first run"))
    await log.close()
    tail = EventTail(path)
    replaced, events = tail.poll(1 << 20)
    assert not replaced and len(events) == 5
    log = EventLog(path)
    log.emit(ev.WorkerDied("w0", "second run, which is longer than the first"))
    await log.close()
    replaced, events = tail.poll(1 << 20)
    assert replaced and [e.why for e in events] == ["second run, which is longer than the first"]
    path.write_bytes(b"FLXEVLOG" + (99).to_bytes(4, "little"))
    assert tail.poll(1 << 20)[1] == [] and "newer FlexMARL" in tail.problem


async def test_an_event_tail_reads_a_log_of_many_segments_a_slice_at_a_time_as_one_log(tmp_path):
    path = tmp_path / "events.log"
    log = EventLog(path, max_bytes_per_segment=400)
    for i in range(60):
        log.emit(ev.WorkerDied(f"w{i}", "x" * 20))
    await log.close()
    tail, seen = EventTail(path), []
    while True:
        replaced, events = tail.poll(100)
        assert not replaced
        if not events:
            break
        seen += events
    assert [e.seq for e in seen] == list(range(60)) and tail.bytes_read == tail.size() > 400 * 5


async def test_a_watch_follows_a_run_as_it_grows_and_reads_nothing_twice(tmp_path):
    log = EventLog(tmp_path / "events.log")
    log.emit(ev.RunStarted('[run]\nsteps = 2\n', ["a"], "sync", 0, 1))
    await log.flush()
    metrics = open(tmp_path / "metrics.jsonl", "w")
    watch = RunWatch(tmp_path)
    assert not watch.refresh()
    assert watch.header()["step"] == 0 and watch.header()["steps"] == 2  # from the log's config: no config.toml yet
    for step in (1, 2):
        log.emit(ev.OptimizerStep("a", "t0", step, 4))
        await log.flush()
        metrics.write(json.dumps({"step": step, "agent": "a", "version": step, "reward_mean": step / 10,
                                  "samples": 4, "time": 10.0 * step}) + "\n")
        metrics.flush()
        watch.refresh()
        header = watch.header()
        assert header["step"] == step and header["log"]["events"] == 1 + step and header["log"]["caught_up"]
    assert watch.curves.train["reward"] == [0.1, 0.2] and watch.curves.train["samples_s"] == [None, 0.8]
    metrics.close()
    await log.close()
    before = {p.name: (p.read_bytes(), os.stat(p).st_mtime_ns) for p in tmp_path.iterdir()}
    watch.refresh()
    watch.header()
    assert {p.name: (p.read_bytes(), os.stat(p).st_mtime_ns) for p in tmp_path.iterdir()} == before  # never written
