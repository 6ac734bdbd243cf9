import asyncio
import os
import time
import zlib

import msgspec
import pytest

from flexmarl.runtime import events as ev
from flexmarl.runtime import legacy_events as old
from flexmarl.runtime.keys import SCORE_TURN, GroupKey
from flexmarl.runtime.eventlog import (HEADER_BYTES, MAGIC, MAX_EVENTS_PER_FRAME, EventLog, EventLogError,
                                       EventLogVersionError, encode_frame, read_events,
                                       segment_path, segment_paths)

G1, G2 = GroupKey("s2q0", "solver", "1a2b3c4d-0"), GroupKey("s2q1", "solver", "1a2b3c4d-b0-1")

EXAMPLES = [
    ev.RunStarted("[run]\nseed = 1\n", ["planner", "solver"], "async", 1, 7),
    ev.WorkerJoined("r0", "rollout", "host", 1234),
    ev.WorkerDied("r0", "missed 3 heartbeats"),
    ev.WorkerRestarted("r0", "rollout", -9, 1, 1240),
    ev.RunFinished(10, 123.5),
    ev.RunResumed(4, "runs/x/checkpoints/step-000004", "[run]\nseed = 1\n"),
    ev.CheckpointWritten(4, "runs/x/checkpoints/step-000004", 123456, 0.25),
    ev.EventsLost("runs/x/events.log", 4096, 64, 120, 133, "damaged frame: checksum mismatch"),
    ev.BatchStarted(2, 16, 0, [3, 1, 4]),
    ev.EvaluationDone(4, 16, 1, {"planner": 0.5}),
    ev.RequestsDispatched("r0", "solver", 3, 40, ev.Parts([G1, G1], [0, 1], [2, 1], [0, 1])),
    ev.RequestsCompleted("r0", "solver", 3, [0, 1], 17, parts=ev.Parts([G1, G1], [0, 1], [2, 1], [0, 1])),
    ev.GroupOpened(G1, 2, 2),
    ev.GroupComplete(G1, [1.0, 0.0]),
    ev.SamplesDropped("solver", ev.whole([(G2, 3)]), "too stale"),
    ev.MicroBatchFormed("solver", "t0", 2, ev.whole([(G1, 2)]), [0, 1]),
    ev.GroupServed(G2, 2, [1.0]),
    ev.TeacherScored(G1, 1, "teacher", [0, 0]),
    ev.GroupTargets(1, {"solver": 8}),
    ev.EpisodesDrawn(1, 3, {"solver": 2}),
    ev.EpisodeAdmitted("s1q2", 1, 2),
    ev.EpisodeAssigned("s1q2", 1, 2),
    ev.EpisodeAbandoned("s1p0", 1, 2),
    ev.SnapshotRefreshed("past", "solver", 5),
    ev.MicroBatchTrained("solver", "t0", 2, 2, 0.25),
    ev.OptimizerStep("solver", "t0", 2, 64),
    ev.StepSkipped("solver", "t0", 3, float("inf"), 1),
    ev.TrainingRestored("solver", 2, 4, "worker t1 is gone: missed heartbeats"),
    ev.WeightSyncStarted("solver", 2, ["r0", "r1"]),
    ev.WeightSyncFinished("solver", 2, 0.5, 1 << 20),
    ev.AllocationChanged("rollout", "solver", ["r0", "r1"], "load disparity 6.1 > 5"),
    ev.DemandObserved(812.25, 5.0, {"solver": {"r0": 900.0}, "planner": {"r1": 0.0, "r2": 12.5}},
                      {"solver": 4000.0, "planner": 80.0}, {"solver": {"r0": 3.5}, "planner": {}}),
    ev.RebalanceDecided(["r1"], "planner", "solver", "disparity 7.2 >= 5"),
    ev.PlacementMeasured(1, {"solver": {"r0": 0.0}, "planner": {"r1": 0.0, "r2": 12.5}},
                         {"solver": 9000.0, "planner": 600.0}, {"solver": 0.9, "planner": 0.1}),
]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        self.now += 0.5
        return self.now


async def write(path, events, flush_each=False, **kwargs):
    """Writes `events` in one write (one frame), or one write (frame) each."""
    log = EventLog(path, **kwargs)
    for e in events:
        log.emit(e)
        if flush_each:
            await log.flush()
    await log.close()
    return log


def test_examples_cover_every_event_type():
    assert {type(e) for e in EXAMPLES} == set(ev.EVENT_TYPES)


async def test_every_event_type_survives_a_round_trip_through_the_file(tmp_path):
    path = tmp_path / "events.log"
    await write(path, EXAMPLES, clock=FakeClock())
    events, problem = read_events(path)
    assert problem is None
    assert events == EXAMPLES
    assert [e.seq for e in events] == list(range(len(EXAMPLES)))
    assert [e.t for e in events] == [0.5 * (i + 1) for i in range(len(EXAMPLES))]


async def test_rotation_produces_several_segments_and_the_reader_returns_all_events_in_order(tmp_path):
    path = tmp_path / "events.log"
    log = EventLog(path, max_bytes_per_segment=400)
    for i in range(60):
        log.emit(ev.SamplesDropped("a", ev.whole([(GroupKey("e", "a", f"s{i}"), 2)]), "test"))
        if i % 7 == 0:
            await log.flush()
    await log.close()
    segments = segment_paths(path)
    assert len(segments) > 3
    assert segments[1] == segment_path(path, 1) == tmp_path / "events.log.1"
    for seg in segments:
        data = seg.read_bytes()
        assert data.startswith(MAGIC) and HEADER_BYTES < len(data) <= 400
    events, problem = read_events(path)
    assert problem is None
    assert [e.parts.keys[0].call for e in events] == [f"s{i}" for i in range(60)]
    assert [e.seq for e in events] == list(range(60))


async def test_an_existing_log_and_its_segments_are_replaced_not_appended_to(tmp_path):
    path = tmp_path / "events.log"
    await write(path, [ev.WorkerDied(f"w{i}", "old run") for i in range(40)], max_bytes_per_segment=200)
    assert len(segment_paths(path)) > 2
    await write(path, EXAMPLES[:2])
    assert segment_paths(path) == [path]
    assert read_events(path) == (EXAMPLES[:2], None)


async def test_a_resumed_run_continues_the_log_after_cutting_off_the_torn_tail(tmp_path):
    path = tmp_path / "events.log"
    first = [ev.WorkerDied(f"w{i}", "before the crash") for i in range(30)]
    await write(path, first, max_bytes_per_segment=300, clock=FakeClock())
    last = segment_paths(path)[-1]
    last.write_bytes(last.read_bytes()[:-3])  # the crash tore the last frame
    kept, problem = read_events(path)
    n = len(kept)  # the events before the torn frame (its events are lost with it)
    assert "truncated frame" in problem and 0 < n < 30 and kept == first[:n]
    clock = FakeClock()
    clock.now = 5000.0  # another process: its own clock
    more = [ev.RunResumed(4, "ckpt", "[run]"), ev.WorkerDied("w99", "after")]
    await write(path, more, max_bytes_per_segment=300, clock=clock, append=True)
    events, problem = read_events(path)
    assert problem is None
    assert events[:n] == kept and events[n:] == more
    assert [e.seq for e in events] == list(range(n + 2))  # seq goes on where the intact part ended
    assert events[n].t > events[n - 1].t  # and so does time


async def test_a_truncated_file_is_read_up_to_the_torn_frame_naming_the_offset(tmp_path):
    path = tmp_path / "events.log"
    await write(path, EXAMPLES, flush_each=True)
    data = path.read_bytes()
    last_frame_at = len(data) - len(encode_frame(msgspec.msgpack.encode(EXAMPLES[-1])))
    path.write_bytes(data[:-3])
    events, problem = read_events(path)
    assert events == EXAMPLES[:-1]
    assert f"{path}: byte offset {last_frame_at}: truncated frame" in problem


async def test_a_corrupted_byte_costs_its_frame_alone_and_the_frames_after_it_are_read(tmp_path):
    path = tmp_path / "events.log"
    await write(path, EXAMPLES, flush_each=True)
    data = bytearray(path.read_bytes())
    fifth_frame_at = HEADER_BYTES + sum(len(encode_frame(msgspec.msgpack.encode(e))) for e in EXAMPLES[:4])
    fifth_size = len(encode_frame(msgspec.msgpack.encode(EXAMPLES[4])))
    data[fifth_frame_at + 10] ^= 0x40
    path.write_bytes(bytes(data))
    events, problem = read_events(path)
    lost = events[4]
    assert events[:4] == EXAMPLES[:4] and events[5:] == EXAMPLES[5:]
    assert isinstance(lost, ev.EventsLost) and (lost.first_seq, lost.next_seq, lost.seq) == (4, 5, 4)
    assert (lost.segment, lost.offset, lost.nbytes) == (str(path), fifth_frame_at, fifth_size)
    assert problem == (f"{path}: byte offset {fifth_frame_at}: damaged frame: checksum mismatch; 1 event (seq 4-4) "
                       f"were in its {fifth_size} bytes; read on after it")


async def test_zeroed_bytes_in_the_middle_cost_the_frames_they_touch_and_the_rest_is_read(tmp_path):
    path = tmp_path / "events.log"
    many = [ev.WorkerDied(f"w{i}", "x" * (i % 7)) for i in range(200)]
    await write(path, many, flush_each=True)
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at:at + 64] = bytes(64)
    path.write_bytes(bytes(data))
    events, problem = read_events(path)
    (lost,) = [e for e in events if isinstance(e, ev.EventsLost)]
    kept = [e for e in events if not isinstance(e, ev.EventsLost)]
    assert kept == many[:lost.first_seq] + many[lost.next_seq:]
    assert 1 <= lost.next_seq - lost.first_seq <= 6 and lost.offset <= at < lost.offset + lost.nbytes
    assert "read on after it" in problem


async def test_damage_in_a_later_segment_is_passed_over_to_the_segments_after_it(tmp_path):
    path = tmp_path / "events.log"
    written = [ev.WorkerDied(f"w{i}", "x") for i in range(30)]
    await write(path, written, max_bytes_per_segment=200)
    assert len(segment_paths(path)) > 3
    second = segment_path(path, 1)
    second.write_bytes(second.read_bytes()[:HEADER_BYTES + 5])
    events, problem = read_events(path)
    (lost,) = [e for e in events if isinstance(e, ev.EventsLost)]
    assert [e for e in events if e is not lost] == written[:lost.first_seq] + written[lost.next_seq:]
    assert lost.segment == str(second) and lost.offset == HEADER_BYTES and lost.next_seq > lost.first_seq
    assert problem.startswith(f"{second}: byte offset {HEADER_BYTES}: truncated frame")


async def test_a_resumed_run_keeps_every_intact_frame_after_damage_and_says_what_it_lost(tmp_path):
    path = tmp_path / "events.log"
    first = [ev.WorkerDied(f"w{i}", "before the crash") for i in range(60)]
    await write(path, first, flush_each=True, clock=FakeClock())
    data = bytearray(path.read_bytes())
    data[len(data) // 3:len(data) // 3 + 64] = bytes(64)  # damage in the middle
    path.write_bytes(bytes(data[:-3]))  # and a torn tail
    resumed = EventLog(path, append=True)
    (lost,) = resumed.lost
    assert "truncated frame" in resumed.torn
    more = [ev.RunResumed(4, "ckpt", "[run]")]
    task = asyncio.create_task(resumed.run())
    for e in more:
        resumed.emit(e)
    await resumed.close()
    await task
    events, problem = read_events(path)
    kept = [e for e in events if not isinstance(e, ev.EventsLost)]
    assert kept == first[:lost.first_seq] + first[lost.next_seq:59] + more  # only the torn last frame cut
    assert events[-1].seq == 59 and "read on after it" in problem and "truncated" not in problem


async def test_a_log_in_a_newer_format_is_refused(tmp_path):
    path = tmp_path / "events.log"
    await write(path, EXAMPLES[:1])
    newer = ev.FORMAT_VERSION + 1
    path.write_bytes(MAGIC + newer.to_bytes(4, "little") + path.read_bytes()[HEADER_BYTES:])
    with pytest.raises(EventLogVersionError, match=rf"newer FlexMARL \(format {newer}\); upgrade to read it"):
        read_events(path)


@pytest.mark.parametrize("one_frame", [False, True], ids=["frames of their own", "one frame"])
async def test_events_of_a_kind_added_later_are_skipped_and_mentioned_and_the_rest_kept(tmp_path, one_frame):
    path = tmp_path / "events.log"
    await write(path, EXAMPLES[:1])
    future = msgspec.msgpack.encode({"event": "AgentCloned", "seq": 1, "t": 1.0, "agent": "x"})
    later = ev.WorkerDied("r0", "gone")
    later.seq, later.t = 2, 2.0
    bodies = (future, msgspec.msgpack.encode(later))
    with open(path, "ab") as f:
        f.write(encode_frame(*bodies) if one_frame else b"".join(encode_frame(b) for b in bodies))
    events, problem = read_events(path)
    assert events == [EXAMPLES[0], later]
    assert "AgentCloned x1" in problem


async def test_emit_is_synchronous_and_only_flush_or_run_touches_the_disk(tmp_path, monkeypatch):
    path = tmp_path / "events.log"
    log = EventLog(path)
    threads = []
    real_to_thread = asyncio.to_thread
    monkeypatch.setattr(asyncio, "to_thread", lambda *a, **k: threads.append(a) or real_to_thread(*a, **k))
    returned = log.emit(ev.WorkerJoined("r0", "rollout", "h", 1))
    assert returned.seq == 0 and not asyncio.iscoroutine(returned)
    assert not path.exists() and threads == []
    await log.flush()
    assert read_events(path) == ([returned], None)
    await log.close()


def slow_disk(monkeypatch, log, seconds, fsyncs=None):
    """Each of `log`'s writes takes `seconds` longer; with `fsyncs` (a list) only those that
    fsync do, and each appends to it how many events it writes."""
    real_write = log._write

    def slow_write(bodies, fsync):
        if fsyncs is None or fsync:
            if fsyncs is not None:
                fsyncs.append(len(bodies))
            time.sleep(seconds)
        real_write(bodies, fsync)

    monkeypatch.setattr(log, "_write", slow_write)


async def test_the_writer_never_blocks_the_loop_while_the_disk_is_slow(tmp_path, monkeypatch):
    path = tmp_path / "events.log"
    log = EventLog(path)
    slow_disk(monkeypatch, log, 0.3)
    writer = asyncio.create_task(log.run(), name="event-log")
    gaps, last = [], time.monotonic()
    started = last
    log.emit(ev.WorkerJoined("r0", "rollout", "h", 1))
    while time.monotonic() - started < 0.5:
        await asyncio.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        log.emit(ev.WorkerDied("r0", "tick"))  # emits keep landing while a write is under way
    assert max(gaps) < 0.15
    await log.close()
    await asyncio.wait_for(writer, 5)
    events, problem = read_events(path)
    assert problem is None and len(events) == log.next_seq > 10


async def test_cancelling_the_writer_mid_write_loses_and_reorders_nothing(tmp_path, monkeypatch):
    path = tmp_path / "events.log"
    log = EventLog(path)
    real_write, calls = log._write, []

    def first_write_is_slow(frames, fsync):
        calls.append(frames)
        if len(calls) == 1:
            time.sleep(0.2)
        real_write(frames, fsync)

    monkeypatch.setattr(log, "_write", first_write_is_slow)
    writer = asyncio.create_task(log.run(), name="event-log")
    log.emit(EXAMPLES[0])
    await asyncio.sleep(0.05)  # the first write is now sleeping in its thread
    writer.cancel()
    log.emit(EXAMPLES[1])
    await log.close()
    assert read_events(path) == (EXAMPLES[:2], None)


async def test_the_background_task_writes_without_flush_and_returns_after_close(tmp_path):
    path = tmp_path / "events.log"
    log = EventLog(path)
    writer = asyncio.create_task(log.run(), name="event-log")
    log.emit(EXAMPLES[0])
    for _ in range(200):
        await asyncio.sleep(0.01)
        if path.exists() and path.stat().st_size > HEADER_BYTES:
            break
    assert read_events(path)[0] == [EXAMPLES[0]]
    await log.close()
    await asyncio.wait_for(writer, 5)
    with pytest.raises(EventLogError, match="closed"):
        log.emit(EXAMPLES[1])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_a_full_disk_stops_the_writer_with_a_clear_error():
    log = EventLog("/dev/full")
    writer = asyncio.create_task(log.run(), name="event-log")
    log.emit(EXAMPLES[0])
    with pytest.raises(EventLogError, match="cannot write the event log /dev/full: No space left"):
        await asyncio.wait_for(writer, 5)
    with pytest.raises(EventLogError, match="failed earlier"):
        log.emit(EXAMPLES[1])
    with pytest.raises(EventLogError):
        await log.flush()
    with pytest.raises(EventLogError):
        await log.close()  # still closes the file


async def test_a_tail_returns_each_event_once_as_the_log_grows_across_segments_and_a_resume(tmp_path):
    from flexmarl.runtime.eventlog import LogTail

    path = tmp_path / "events.log"
    tail = LogTail(path)
    assert tail.poll() == []  # no log yet
    log = EventLog(path, max_bytes_per_segment=300)
    seen = []
    for i in range(40):
        log.emit(ev.WorkerDied(f"w{i}", "x"))
        if i % 5 == 0:
            await log.flush()
            seen += tail.poll()
    await log.close()
    seen += tail.poll()
    last = segment_paths(path)[-1]
    last.write_bytes(last.read_bytes() + b"\x05\x00")  # a frame being written: not read yet
    assert tail.poll() == []
    await write(path, [ev.RunResumed(1, "c", "")], max_bytes_per_segment=300, append=True)  # cuts it, goes on
    seen += tail.poll()
    assert [e.seq for e in seen] == list(range(41)) and isinstance(seen[-1], ev.RunResumed)
    assert len(segment_paths(path)) > 3


async def test_a_tail_read_in_small_slices_returns_every_event_once_and_says_how_far_it_read(tmp_path):
    """A slice smaller than a frame still reads that whole frame; the slices end where the
    log does, across segments, and the bytes read add up to the files' sizes."""
    from flexmarl.runtime.eventlog import LogTail

    path = tmp_path / "events.log"
    log = EventLog(path, max_bytes_per_segment=2000)
    for i in range(300):
        log.emit(ev.WorkerDied(f"w{i}", "x" * (i % 7)))
        if i % 9 == 0:
            await log.flush()
    await log.close()
    assert len(segment_paths(path)) > 3
    for size in (1, 50, 700, 10**9):
        tail, seen, polls = LogTail(path), [], 0
        while batch := tail.poll(max_bytes=size):
            seen += batch
            polls += 1
        assert [e.seq for e in seen] == list(range(300))
        assert tail.bytes_read == sum(p.stat().st_size for p in segment_paths(path))
        assert polls > 10 if size < 1000 else polls == 1


def one_event_frame(body):
    """A frame of formats 1 and 2: one event, no array around it."""
    length = len(body).to_bytes(4, "little")
    return length + body + zlib.crc32(body, zlib.crc32(length)).to_bytes(4, "little")


async def test_one_write_is_one_frame_and_a_long_write_is_cut_into_frames_of_bounded_size(tmp_path):
    path = tmp_path / "events.log"
    await write(path, EXAMPLES)
    bodies = [msgspec.msgpack.encode(e) for e in EXAMPLES]
    assert path.read_bytes() == MAGIC + ev.FORMAT_VERSION.to_bytes(4, "little") + encode_frame(*bodies)
    many = [ev.WorkerDied(f"w{i}", "x") for i in range(MAX_EVENTS_PER_FRAME + 10)]
    await write(path, many)
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x40  # damage in the second frame keeps the first whole
    path.write_bytes(bytes(data))
    events, problem = read_events(path)
    assert events == many[:MAX_EVENTS_PER_FRAME] and "checksum mismatch" in problem


async def test_a_log_of_format_2_is_read_and_a_resumed_run_goes_on_in_a_segment_of_its_own(tmp_path):
    path = tmp_path / "events.log"
    old = [ev.WorkerDied(f"w{i}", "format 2") for i in range(5)]
    for i, e in enumerate(old):
        e.seq, e.t = i, float(i)
    path.write_bytes(MAGIC + (2).to_bytes(4, "little")
                     + b"".join(one_event_frame(msgspec.msgpack.encode(e)) for e in old) + b"\x07\x00")  # torn tail
    events, problem = read_events(path)
    assert events == old and "truncated frame" in problem
    more = [ev.RunResumed(4, "ckpt", "[run]"), ev.WorkerDied("w9", "format 3")]
    await write(path, more, append=True)
    assert segment_paths(path) == [path, segment_path(path, 1)]
    assert path.read_bytes()[:HEADER_BYTES] == MAGIC + (2).to_bytes(4, "little")  # the old segment keeps its format
    events, problem = read_events(path)
    assert problem is None and events == old + more
    assert [e.seq for e in events] == list(range(7))


def stamped(events):
    for i, e in enumerate(events):
        e.seq, e.t = i, float(i)
    return events


async def test_a_log_of_format_3_names_groups_and_turns_by_typed_keys_when_read(tmp_path):
    """Before format 4 groups, samples and later turns were strings (`GROUP/INDEX`,
    `SAMPLE@TURN`): read, every event names them by keys, the same string the same key."""
    group = "s2q0/solver-1a2b3c4d-0"
    written = stamped([
        old.GroupOpened("solver", group, [], 2, 3),
        old.RequestsDispatched("r0", "solver", 3, [], 40, old.Parts([group, f"{group}/1@1"], [0, 0], [3, 1])),
        old.RequestsCompleted("r0", "solver", 3, [], [0, 1], 17, parts=old.Parts([group, f"{group}/1@1"], [0, 0], [3, 1])),
        old.GroupComplete("solver", group, [1.0, 0.0, 0.5], 12),
        old.MicroBatchFormed("solver", "", 3, [f"{group}/0", f"{group}/1", f"{group}/2"], [0, 0, 0]),
        old.SamplesDropped("solver", ["hand-made"], "a name of no grammar"),
        ev.OptimizerStep("solver", "t0", 3, 3)])
    path = tmp_path / "events.log"
    path.write_bytes(MAGIC + (3).to_bytes(4, "little") + encode_frame(*map(msgspec.msgpack.encode, written)))
    events, problem = read_events(path)
    assert problem is None and [e.seq for e in events] == list(range(7))
    key = G1
    assert events[:5] == stamped([
        ev.GroupOpened(key, 2, 3),
        ev.RequestsDispatched("r0", "solver", 3, 40, ev.Parts([key, key], [0, 1], [3, 1], [0, 1])),
        ev.RequestsCompleted("r0", "solver", 3, [0, 1], 17, parts=ev.Parts([key, key], [0, 1], [3, 1], [0, 1])),
        ev.GroupComplete(key, [1.0, 0.0, 0.5], 12),
        ev.MicroBatchFormed("solver", "", 3, ev.whole([(key, 3)]), [0, 0, 0])])
    assert events[5].parts == ev.Parts([GroupKey("", "solver", "hand-made")], [0], [1])
    assert str(key) == group and key.sample(1) == f"{group}/1"


async def test_a_log_of_format_3_reads_the_agents_menus_events_by_typed_keys(tmp_path):
    """A frozen agent's GroupServed and a teacher's TeacherScored named groups by strings,
    and a teacher's scoring of member j was the request `GROUP/j@teacher` of the teacher's:
    read, they name the student's group by its key, the scoring as SCORE_TURN."""
    group, judged = "s2q0/solver-1a2b3c4d-0", "s2q0/judge-99-0"
    written = stamped([
        old.GroupOpened("solver", group, [], 2, 3),
        old.GroupOpened("judge", judged, [], 2, 2),
        old.RequestsCompleted("r1", "teacher", 4, [], [5], 3, parts=old.Parts([f"{group}/1@teacher"], [0], [1])),
        old.TeacherScored("solver", group, 2, "teacher", [5, 5, 5]),
        old.GroupServed("judge", judged, 2, [1.0])])
    path = tmp_path / "events.log"
    path.write_bytes(MAGIC + (3).to_bytes(4, "little") + encode_frame(*map(msgspec.msgpack.encode, written)))
    events, problem = read_events(path)
    judge = GroupKey("s2q0", "judge", "99-0")
    assert problem is None
    assert events[2].parts == ev.Parts([G1], [1], [1], [SCORE_TURN])
    assert ev.without_stamp(events[3]) == ev.without_stamp(ev.TeacherScored(G1, 2, "teacher", [5, 5, 5]))
    assert ev.without_stamp(events[4]) == ev.without_stamp(ev.GroupServed(judge, 2, [1.0]))
    assert [e.seq for e in events] == list(range(5)) and (events[3].agent, events[4].agent) == ("solver", "judge")


async def test_a_log_of_format_1_finds_the_members_its_groups_listed(tmp_path):
    written = stamped([old.GroupOpened("a", "g", ["first", "second"], 1),
                       old.RequestsCompleted("r0", "a", 1, ["second", "first"], [2, 1], 4),
                       old.MicroBatchFormed("a", "", 2, ["first", "second"], [1, 2])])
    path = tmp_path / "events.log"
    path.write_bytes(MAGIC + (1).to_bytes(4, "little")
                     + b"".join(one_event_frame(msgspec.msgpack.encode(e)) for e in written))
    events, problem = read_events(path)
    g = GroupKey("", "a", "g")
    assert problem is None and events[0] == stamped([ev.GroupOpened(g, 1, 2)])[0]
    assert (events[1].parts, events[1].versions) == (ev.Parts([g, g], [1, 0], [1, 1]), [2, 1])
    assert events[2].parts == ev.whole([(g, 2)])


async def test_flushes_called_together_share_one_fsync_and_each_returns_with_its_events_on_disk(tmp_path, monkeypatch):
    """A group commit: every agent's optimizer step flushes, and dozens step together."""
    path = tmp_path / "events.log"
    log, fsyncs = EventLog(path), []
    slow_disk(monkeypatch, log, 0.05, fsyncs)

    async def step(i):
        log.emit(ev.WorkerDied(f"w{i}", "step"))
        wanted = log.next_seq
        await log.flush()
        on_disk, problem = read_events(path)
        assert problem is None and len(on_disk) >= wanted  # its own event and every one before it

    await asyncio.gather(*(step(i) for i in range(32)))
    assert len(fsyncs) <= 2 and sum(fsyncs) == 32
    log.emit(ev.WorkerDied("late", "after the others"))  # emitted during no flush: a flush of its own
    await log.flush()
    await log.flush()  # nothing emitted since: nothing to write
    assert len(fsyncs) <= 3
    await log.close()
    events, problem = read_events(path)
    assert problem is None and [e.seq for e in events] == list(range(33))


async def test_a_flush_called_while_another_writes_waits_for_a_write_of_its_own_events(tmp_path, monkeypatch):
    path = tmp_path / "events.log"
    log = EventLog(path)
    slow_disk(monkeypatch, log, 0.1)
    log.emit(EXAMPLES[0])
    first = asyncio.create_task(log.flush())
    await asyncio.sleep(0.03)  # the first flush's write is under way, without EXAMPLES[1]
    log.emit(EXAMPLES[1])
    await log.flush()
    assert read_events(path) == (EXAMPLES[:2], None)
    await first
    await log.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_flushes_sharing_a_write_that_fails_each_raise_its_error():
    log = EventLog("/dev/full")
    log.emit(EXAMPLES[0])
    results = await asyncio.gather(*(log.flush() for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, EventLogError) and "No space left" in str(r) for r in results)
    with pytest.raises(EventLogError, match="failed earlier"):
        await log.flush()
    with pytest.raises(EventLogError):
        await log.close()
