import argparse
import json
import subprocess
import sys

import pytest

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import EventLog
from flexmarl.runtime.keys import GroupKey


GA, GB = GroupKey("e", "a", "ga"), GroupKey("e", "b", "gb")


def part(key, first, size):
    return ev.Parts([key], [first], [size])


def members(key, *indices):
    """Members of a group one by one."""
    return ev.Parts([key] * len(indices), list(indices), [1] * len(indices))


def synthetic_run():
    """A small consistent two-agent run, with times chosen so busy spans are easy to sum.

    r0 serves agent a: two overlapping requests busy 1..4, then loads a's weights 8..9.
    r1 serves agent b: one request busy 1..5. t0 trains a 6..8, publishes a 8..9,
    trains b 9..10. b: 2 trained, 1 dropped, 1 still in flight. The run ends at 12.
    """
    script = [
        (0, ev.RunStarted("", ["a", "b"], "async", 1, 0)),
        (0, ev.WorkerJoined("r0", "rollout", "h", 1)),
        (0, ev.WorkerJoined("r1", "rollout", "h", 2)),
        (0, ev.WorkerJoined("t0", "trainer", "h", 3)),
        (0, ev.AllocationChanged("rollout", "a", ["r0"], "start")),
        (0, ev.AllocationChanged("rollout", "b", ["r1"], "start")),
        (0.5, ev.GroupOpened(GA, 1, 4)),
        (0.5, ev.GroupOpened(GB, 1, 4)),
        (1, ev.RequestsDispatched("r0", "a", 1, 10, part(GA, 0, 2))),
        (1, ev.RequestsDispatched("r1", "b", 2, 20, part(GB, 0, 4))),
        (1.5, ev.RequestsDispatched("r0", "a", 3, 10, part(GA, 2, 2))),
        (3, ev.RequestsCompleted("r0", "a", 1, [0], 5, 40, 10, parts=part(GA, 0, 2))),
        (4, ev.RequestsCompleted("r0", "a", 3, [0], 5, 0, 0, 30, 15, parts=part(GA, 2, 2))),
        (4, ev.GroupComplete(GA, [1.0, 0.0, 1.0, 0.0])),
        (5, ev.RequestsCompleted("r1", "b", 2, [0], 9, parts=part(GB, 0, 4))),
        (5, ev.GroupComplete(GB, [1.0, 1.0, 0.0, 0.0])),
        (6, ev.MicroBatchFormed("a", "t0", 1, part(GA, 0, 4), [0, 0, 0, 0])),
        (8, ev.MicroBatchTrained("a", "t0", 1, 4, 2.0)),
        (8, ev.OptimizerStep("a", "t0", 1, 4)),
        (8, ev.WeightSyncStarted("a", 1, ["r0"])),
        (9, ev.WeightSyncFinished("a", 1, 1.0, 1000)),
        (9, ev.MicroBatchFormed("b", "t0", 1, part(GB, 0, 2), [0, 0])),
        (9.5, ev.SamplesDropped("b", members(GB, 2), "too stale")),
        (10, ev.MicroBatchTrained("b", "t0", 1, 2, 1.0)),
        (10, ev.OptimizerStep("b", "t0", 1, 2)),
        (12, ev.RunFinished(1, 12.0)),
    ]
    for seq, (t, e) in enumerate(script):
        e.seq, e.t = seq, float(t)
    return [e for _, e in script]


def stamped(events, *extra):
    """`events` plus `extra` appended at the end of the log (before nothing else)."""
    out = list(events)
    for e in extra:
        e.seq, e.t = len(out), out[-1].t
        out.append(e)
    return out


async def write_log(path, events, writes=1):
    """Writes `events` through the real writer, keeping their times, in `writes` writes
    (as many frames) of about equal size."""
    clock = {"now": 0.0}
    log = EventLog(path, clock=lambda: clock["now"])
    per_write = -(-len(events) // writes)
    for i, e in enumerate(events):
        clock["now"] = e.t
        log.emit(e)
        if (i + 1) % per_write == 0:
            await log.flush()
    await log.close()
    return path


def args(log, **kw):
    return argparse.Namespace(log=str(log), trace=kw.get("trace"), plot=kw.get("plot"),
                              check=kw.get("check", False))


def test_workers_are_busy_while_requests_are_outstanding_while_training_and_while_syncing():
    s = replay.summarize(synthetic_run())
    assert s.wall_s == 12
    r0, r1, t0 = s.workers["r0"], s.workers["r1"], s.workers["t0"]
    assert (r0.busy_s, r0.idle_s) == (4.0, 8.0)  # 1..4 (overlapping requests count once) + 8..9
    assert (r1.busy_s, r1.idle_s) == (4.0, 8.0)
    assert (t0.busy_s, t0.idle_s) == (4.0, 8.0)  # 6..8 train a, 8..9 publish a, 9..10 train b
    assert r0.utilization == pytest.approx(1 / 3)


def test_per_agent_throughput_and_staleness_histogram_come_from_training_events():
    s = replay.summarize(synthetic_run())
    a, b = s.agents["a"], s.agents["b"]
    assert (a.samples_trained, a.optimizer_steps, a.version) == (4, 1, 1)
    assert (b.samples_trained, b.micro_batches) == (2, 1)
    assert s.staleness == {"a": {0: 4}, "b": {0: 2}}


def test_accounting_reconciles_on_a_consistent_log():
    s = replay.summarize(synthetic_run())
    assert s.errors == []
    totals = {r.agent: r for r in s.accounting if r.total}
    assert (totals["a"].generated, totals["a"].trained, totals["a"].dropped, totals["a"].in_flight) == (4, 4, 0, 0)
    assert (totals["b"].generated, totals["b"].trained, totals["b"].dropped, totals["b"].in_flight) == (4, 2, 1, 1)
    per_version = [(r.agent, r.version, r.generated) for r in s.accounting if not r.total]
    assert per_version == [("a", 0, 4), ("b", 0, 4)]


async def test_a_double_trained_sample_fails_loudly_naming_the_agent_and_counts(tmp_path, capsys):
    events = stamped(synthetic_run(), ev.MicroBatchFormed("a", "t0", 2, members(GA, 1), [0]),
                     ev.OptimizerStep("a", "t0", 2, 1))
    s = replay.summarize(events)
    assert len(s.errors) == 1
    assert "agent 'a'" in s.errors[0]
    assert "generated 4 != trained 5 + dropped 0 + in flight 0" in s.errors[0]
    assert "1 sample(s) trained twice, e.g. e/a-ga/1" in s.errors[0]
    log = await write_log(tmp_path / "events.log", events)
    assert replay.main(args(log)) == 1
    err = capsys.readouterr().err
    assert "ACCOUNTING FAILED: agent 'a'" in err and "trained twice" in err


def test_a_sample_sent_to_a_trainer_twice_is_caught_even_in_a_step_the_log_never_reached():
    s = replay.summarize(stamped(synthetic_run(), ev.MicroBatchFormed("a", "t0", 2, members(GA, 1), [0])))
    assert s.errors == ["agent 'a': samples do not reconcile: generated 4 != trained 4 + dropped 0 + in flight 1 "
                        "(1 sample(s) trained twice, e.g. e/a-ga/1)"]


def test_a_run_stopped_mid_step_counts_its_open_step_in_flight_in_the_table_and_the_accounting_alike():
    """b's micro-batch was formed and trained, but the run stopped before b's step: its
    samples never reached the weights. The agent table and the accounting say the same."""
    events = [e for e in synthetic_run() if not (isinstance(e, (ev.OptimizerStep, ev.RunFinished)) and
                                                 getattr(e, "agent", "b") == "b")]
    s = replay.summarize(events)
    assert s.errors == []
    totals = {r.agent: r for r in s.accounting if r.total}
    assert (totals["b"].generated, totals["b"].trained, totals["b"].dropped, totals["b"].in_flight) == (4, 0, 1, 3)
    assert {a: st.samples_trained for a, st in s.agents.items()} == {a: totals[a].trained for a in "ab"} == \
        {"a": 4, "b": 0}


@pytest.mark.parametrize("extra, why", [
    (ev.SamplesDropped("a", members(GA, 2), "late"), "trained and dropped, e.g. e/a-ga/2"),
    (ev.MicroBatchFormed("b", "t0", 2, members(GroupKey("e", "b", "zz"), 0), [0]),
     "trained without being generated, e.g. e/b-zz/0"),
    (ev.SamplesDropped("b", members(GB, 2, 2), "twice"), "dropped twice, e.g. e/b-gb/2"),
])
def test_every_way_of_breaking_exactly_once_is_reported(extra, why):
    s = replay.summarize(stamped(synthetic_run(), extra))
    assert any(why in e for e in s.errors), s.errors


def test_a_sample_past_the_staleness_bound_is_an_error():
    # max_staleness is 1: b3 generated by version 0 must not train version 3 (lag 2).
    s = replay.summarize(stamped(synthetic_run(), ev.MicroBatchFormed("b", "t0", 3, members(GB, 3), [0])))
    assert s.staleness["b"] == {0: 2, 2: 1}
    assert any("agent 'b': 1 trained sample(s) outside the staleness bound" in e for e in s.errors)


def test_the_summary_prints_as_a_table():
    text = replay.format_summary(replay.summarize(synthetic_run()))
    assert "mode async, max_staleness 1" in text
    assert "sample accounting: generated = trained + dropped + in flight" in text
    assert "MISMATCH" not in text
    assert any(line.split()[:2] == ["r0", "rollout"] and line.split()[-2:] == ["33%", "0"]
               for line in text.splitlines())


def test_the_summary_counts_each_agents_swap_ins_per_step_and_the_seconds_work_waited_on_them():
    events = stamped(synthetic_run()[:-1],
                     ev.AllocationChanged("trainer", "a", [], "parked", swap="out", seconds=0.2),
                     ev.AllocationChanged("trainer", "b", ["t0"], "swapped in", swap="in", seconds=0.5,
                                          waited_s=0.25),
                     ev.AllocationChanged("trainer", "a", ["t0"], "swapped in from a checkpoint"),  # a load, no swap
                     ev.AllocationChanged("rollout", "a", ["r1"], "moved"))
    s = replay.summarize(events)
    assert (s.agents["a"].swap_ins, s.agents["b"].swap_ins) == (0, 1)
    assert s.agents["b"].swap_ins_per_step == 1.0 and s.agents["b"].swap_wait_s == 0.25
    header = next(line for line in replay.format_summary(s).splitlines() if line.startswith("agent"))
    assert "swap-ins/step" in header and "swap wait s" in header


def test_the_trace_json_loads_and_has_one_named_track_per_worker_and_per_agent(tmp_path):
    path = tmp_path / "trace.json"
    replay.write_trace(replay.summarize(synthetic_run()), path)
    with open(path) as f:
        trace = json.load(f)
    names = {e["args"]["name"]: (e["pid"], e["tid"]) for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == {"r0", "r1", "t0", "a", "b"}
    assert len(set(names.values())) == 5
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_track = {name: [e for e in spans if (e["pid"], e["tid"]) == track] for name, track in names.items()}
    assert all(by_track.values())
    r0 = [(e["cat"], e["ts"], e["dur"]) for e in by_track["r0"]]
    assert ("generate", 1e6, 3e6) in r0 and ("sync", 8e6, 1e6) in r0
    assert {e["cat"] for e in by_track["t0"]} == {"train", "step", "sync"}
    assert {e["cat"] for e in by_track["a"]} == {"iteration", "sync"}


def test_the_plot_file_is_written_as_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    replay.write_plot(replay.summarize(synthetic_run()), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_main_writes_trace_and_plot_and_exits_zero_for_a_consistent_log(tmp_path, capsys):
    log = await write_log(tmp_path / "events.log", synthetic_run())
    code = replay.main(args(log, trace=tmp_path / "t.json", plot=tmp_path / "p.png"))
    assert code == 0
    assert (tmp_path / "t.json").exists() and (tmp_path / "p.png").exists()
    assert "sample accounting" in capsys.readouterr().out


async def test_main_summarizes_a_damaged_log_up_to_the_damage_and_says_where(tmp_path, capsys):
    events = synthetic_run()
    log = await write_log(tmp_path / "events.log", events, writes=2)
    log.write_bytes(log.read_bytes()[:-2])
    assert replay.main(args(log)) == 0
    out, err = capsys.readouterr()
    assert f"read {-(-len(events) // 2)} events: {log}: byte offset" in err
    assert "sample accounting" in out


def test_check_reports_the_first_decision_the_redriven_code_makes_differently():
    events = synthetic_run()
    only = (ev.MicroBatchFormed,)

    def check(redrive):
        return replay.check(events, redrive, only)

    assert check(lambda evs: [e for e in evs if isinstance(e, ev.MicroBatchFormed)]) is None

    def redrive_differently(evs):
        formed = [ev.MicroBatchFormed(**_fields(e)) for e in evs if isinstance(e, ev.MicroBatchFormed)]
        formed[1].parts = members(GB, 0, 3)
        return formed

    diff = check(redrive_differently)
    assert diff.startswith("decision 1 differs: the log has (seq 21, t 9.000 s)")
    assert "Parts(e/b-gb/0, e/b-gb/3)" in diff

    assert check(lambda evs: []).startswith("the log has 2 decisions, re-driving made 0")


def _fields(e):
    return {f: getattr(e, f) for f in e.__struct_fields__ if f not in ("seq", "t")}


def run_with_a_restart():
    """synthetic_run, but r1 is killed with b's request outstanding, restarted by the
    launcher, registers again under its id and generates b's samples again."""
    events = []
    for e in synthetic_run():
        if isinstance(e, ev.RequestsCompleted) and e.worker == "r1":
            e.request_id = 4
        events.append(e)
        if isinstance(e, ev.RequestsDispatched) and e.request_id == 3:
            for t, extra in ((2, ev.WorkerDied("r1", "its process (pid 2) exited with code -9")),
                             (2.5, ev.WorkerRestarted("r1", "rollout", -9, 1, 5)),
                             (3, ev.WorkerJoined("r1", "rollout", "h", 5)),
                             (3, ev.AllocationChanged("rollout", "b", ["r1"], "r1 rejoined")),
                             (3.5, ev.RequestsDispatched("r1", "b", 4, 20, part(GB, 0, 4)))):
                extra.t = float(t)
                events.append(extra)
    for seq, e in enumerate(events):
        e.seq = seq
    return events


async def test_a_worker_restarted_under_its_id_is_one_worker_with_its_restarts_counted(tmp_path, capsys):
    s = replay.summarize(run_with_a_restart())
    assert s.errors == []
    r1 = s.workers["r1"]
    assert r1.restarts == 1 and r1.role == "rollout"
    assert (r1.start, r1.end) == (0.0, 12.0)  # back after dying: one life line, its downtime idle
    assert r1.busy_s == 1.0 + 1.5  # 1..2 lost with the process, then 3.5..5 again
    log = await write_log(tmp_path / "events.log", run_with_a_restart())
    assert replay.main(args(log)) == 0
    assert any(line.split()[:2] == ["r1", "rollout"] and line.split()[-1] == "1"
               for line in capsys.readouterr().out.splitlines())


def crashed_and_resumed_run():
    """Set-up until 2; a request under way at 3 when the controller is SIGKILLed after its
    event at 4; resumed at 100, set up again until 110, one request 111..112, done at 113."""
    script = [
        (0, ev.RunStarted("", ["a"], "sync", 0, 0)),
        (0, ev.WorkerJoined("r0", "rollout", "h", 1)),
        (2, ev.BatchStarted(1, 0)),
        (3, ev.RequestsDispatched("r0", "a", 1, 10, part(GA, 0, 2))),
        (4, ev.GroupOpened(GA, 1, 2)),
        (100, ev.RunResumed(0, "", "")),
        (100, ev.WorkerJoined("r0", "rollout", "h", 2)),
        (110, ev.BatchStarted(1, 0)),
        (111, ev.RequestsDispatched("r0", "a", 2, 10, part(GroupKey("e", "a", "gc"), 0, 2))),
        (112, ev.RequestsCompleted("r0", "a", 2, [0], 5, parts=part(GroupKey("e", "a", "gc"), 0, 2))),
        (113, ev.RunFinished(1, 3.0)),
    ]
    for seq, (t, e) in enumerate(script):
        e.seq, e.t = seq, float(t)
    return [e for _, e in script]


def test_a_span_left_open_by_a_crash_ends_at_the_controllers_last_event():
    r0 = replay.summarize(crashed_and_resumed_run()).workers["r0"]
    assert r0.busy_s == 2.0  # 3..4 before the crash, 111..112 after the resume
    assert [(sp.start, sp.end) for sp in r0.spans] == [(3.0, 4.0), (111.0, 112.0)]


def test_throughput_counts_training_time_only_not_set_up_or_the_time_a_crashed_run_lay_dead():
    s = replay.summarize(crashed_and_resumed_run())
    assert s.wall_s == 113 and s.training_s == (4 - 2) + (113 - 110)


def test_prefix_cache_hits_are_shown_for_first_turns_and_later_turns():
    s = replay.summarize(synthetic_run())
    assert s.agents["a"].hit_rate() == 0.25 and s.agents["a"].hit_rate(later=True) == 0.5
    text = replay.format_summary(s)
    assert "prefix hits" in text and "25.0%" in text and "50.0%" in text


def run_stopped_mid_step(first_of_step_2="g3"):
    """Agent a, micro-batches of 2 (one group each): step 1 taken; in step 2 three groups
    are ready and one micro-batch was cut when the run stopped (an error, a crash)."""
    from flexmarl.runtime.config import dump_toml, load_config

    cfg = load_config(None, ["pipeline.micro_batch=2", "agents.a.model='m'"], defaults={})
    groups = {f"g{i}": GroupKey("s1q0", "a", f"g{i}") for i in range(1, 6)}
    events = [ev.RunStarted(dump_toml(cfg), ["a"], "async", 0, 0)]
    for g, batch in (("g1", 1), ("g2", 1), ("g3", 2), ("g4", 2), ("g5", 2)):
        # on-policy: batch t is generated by version t - 1
        events += [ev.GroupOpened(groups[g], batch, 2), ev.RequestsCompleted("r0", "a", 1, [batch - 1], 2,
                                                                            parts=part(groups[g], 0, 2)),
                   ev.GroupComplete(groups[g], [1.0, 0.0], 3)]
    events += [ev.MicroBatchFormed("a", "", 1, part(groups["g1"], 0, 2), [0, 0]),
               ev.MicroBatchFormed("a", "", 1, part(groups["g2"], 0, 2), [0, 0]),
               ev.OptimizerStep("a", "t0", 1, 4), ev.MicroBatchFormed("a", "", 2, part(groups[first_of_step_2], 0, 2),
                                                                     [1, 1])]
    for seq, e in enumerate(events):
        e.seq, e.t = seq, float(seq)
    return events


async def test_a_run_stopped_mid_step_replays_with_check_its_open_step_reported_as_open(tmp_path, capsys):
    events = run_stopped_mid_step()
    assert replay.check(events) is None  # the open step's micro-batch is the first the rules cut
    assert "differs" in replay.check(run_stopped_mid_step(first_of_step_2="g4"))  # a wrong one is still caught
    s = replay.summarize(events)
    assert s.open_steps == {"a": [2]} and s.errors == []
    log = await write_log(tmp_path / "events.log", events)
    assert replay.main(args(log, check=True)) == 0
    out = capsys.readouterr().out
    assert "the log ends mid-step (the run stopped before these steps were taken; their samples are in flight): " \
           "a step 2" in out
    assert "(the steps left open agree as far as the log goes)" in out


async def test_replay_takes_a_run_directory_for_its_log_and_says_when_it_holds_none(tmp_path, capsys):
    await write_log(tmp_path / "run" / "events.log", synthetic_run())
    assert replay.main(args(tmp_path / "run")) == 0
    assert "mode async, max_staleness 1" in capsys.readouterr().out
    assert replay.main(args(tmp_path)) == 1
    assert f"flexmarl replay: {tmp_path} holds no events.log" in capsys.readouterr().err


async def test_replay_imports_no_torch_event_loop_or_worker_package_so_it_starts_in_a_fraction_of_a_second(
        tmp_path):
    log = await write_log(tmp_path / "events.log", synthetic_run())
    code = "\n".join([
        "import sys",
        "from flexmarl.controller import cli",
        "try:",
        f"    cli.main(['replay', {str(log)!r}])",
        "except SystemExit as end:",
        "    print('exit', end.code)",
        "heavy = ('torch', 'asyncio', 'zmq', 'flexmarl.workers.main', 'flexmarl.runtime.aio',",
        "         'flexmarl.controller.replay.redrive', 'flexmarl.controller.state.store')  # --check's",
        "print('loaded:', [name for name in heavy if name in sys.modules])",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "sample accounting" in out.stdout and "exit 0" in out.stdout, out.stderr
    assert "loaded: []" in out.stdout


# ---------------------------------------------------------------- logs of the formats before typed keys

def in_an_old_format(events):
    """`events` as the writer of format 3 wrote them: groups, samples and later turns named
    by strings (`GROUP/INDEX`, `SAMPLE@TURN`), micro-batches and drops by their samples."""
    from flexmarl.runtime import legacy_events as old

    def names(parts):
        return [f"{key}/{j}" if not turn else f"{key}/{first}@{turn}" for key, first, size, turn in parts
                for j in range(first, first + size)]

    def old_parts(parts):
        keys = [str(key) if not turn else f"{key}/{first}@{turn}" for key, first, size, turn in parts]
        return old.Parts(keys, [first if not turn else 0 for _, first, _, turn in parts], list(parts.sizes))

    out = []
    for e in events:
        kind = type(e)
        if kind is ev.GroupOpened:
            o = old.GroupOpened(e.agent, str(e.key), [], e.batch, e.n)
        elif kind is ev.GroupComplete:
            o = old.GroupComplete(e.agent, str(e.key), e.rewards, e.tokens)
        elif kind is ev.SamplesDropped:
            o = old.SamplesDropped(e.agent, names(e.parts), e.why)
        elif kind is ev.MicroBatchFormed:
            o = old.MicroBatchFormed(e.agent, e.trainer, e.version, names(e.parts), e.min_versions)
        elif kind is ev.RequestsDispatched:
            o = old.RequestsDispatched(e.worker, e.agent, e.request_id, [], e.tokens, old_parts(e.parts))
        elif kind is ev.RequestsCompleted:
            o = old.RequestsCompleted(e.worker, e.agent, e.request_id, [], e.versions, e.tokens, e.prompt_tokens,
                                      e.cached_tokens, e.turn_prompt_tokens, e.turn_cached_tokens, old_parts(e.parts))
        else:
            o = e
        o.seq, o.t = e.seq, e.t
        out.append(o)
    return out


def write_format_3(path, events):
    import msgspec

    from flexmarl.runtime.eventlog import MAGIC, encode_frame

    path.write_bytes(MAGIC + (3).to_bytes(4, "little") + encode_frame(*map(msgspec.msgpack.encode, events)))
    return path


@pytest.mark.parametrize("run", [synthetic_run, run_with_a_restart, crashed_and_resumed_run, run_stopped_mid_step])
def test_a_log_of_format_3_reads_as_format_4_and_replays_checks_and_accounts_alike(tmp_path, run):
    from flexmarl.runtime.eventlog import read_events

    events = run()
    read, problem = read_events(write_format_3(tmp_path / "events.log", in_an_old_format(events)))
    assert problem is None and read == events
    old, new = replay.summarize(read), replay.summarize(events)
    assert (old.accounting, old.errors, old.staleness, old.open_steps) == \
        (new.accounting, new.errors, new.staleness, new.open_steps)
    if run is run_stopped_mid_step:
        assert replay.check(read) is None


FIXTURE = __import__("pathlib").Path(__file__).parent / "format3_run"


def test_a_real_run_logged_in_format_3_replays_checks_and_reconciles(tmp_path):
    """A run of the controller as it was before keys were typed (bench/system/controller_scale.py's
    chain on the fake cluster: 3 agents, 4 instances, async, K = 1, 2 steps of 3 queries),
    its log as that writer wrote it: `flexmarl replay --check` reads it, re-drives its
    decisions the same and reconciles every sample."""
    from flexmarl.runtime.eventlog import read_events

    events, problem = read_events(FIXTURE / "events.log")
    assert problem is None and events
    s = replay.summarize(events)
    assert s.errors == [] and all(r.reconciles for r in s.accounting)
    totals = [r for r in s.accounting if r.total]
    assert sum(r.trained for r in totals) == sum(e.samples for e in events if isinstance(e, ev.OptimizerStep)) > 0
    assert replay.check(events) is None
    assert replay.main(args(FIXTURE / "events.log", check=True)) == 0
