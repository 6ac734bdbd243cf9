"""One agent's pipeline with fakes of what it is handed (allocator, weight sync, trainer
server, metrics): micro-batches go out while rollout runs (async) or after it (sync),
then exactly one optimizer step over every sample, then one sync."""

import asyncio
import contextlib
from pathlib import Path

import pytest

from store_fill import filled, key

from flexmarl.controller.state.failures import RunFailed
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.schedule import BatchSchedule
from flexmarl.controller.state.store import ExperienceStore, TurnSampling
from flexmarl.controller.train.pipeline import AgentPipeline
from flexmarl.runtime import protocol
from flexmarl.runtime.checksums import DamagedFile
from flexmarl.runtime.config import PipelineConfig


class FakeAllocator:
    def __init__(self):
        self.held = 0
        self.lost, self.recovered = {}, []
        self.resident = {}  # agent -> trainer: none on a trainer, so every group wakes the pipeline

    async def acquire(self, agent, lost="wait"):
        assert lost == "raise" or agent not in self.lost
        if agent in self.lost:
            from flexmarl.controller.train.allocator import AgentLost
            raise AgentLost(agent)
        self.held += 1
        return "t0"

    def recover(self, agent, state, version, checksum=""):
        self.lost.pop(agent)
        self.recovered.append((agent, state, version))

    def release(self, agent):
        self.held -= 1

    def prefetch(self, agent):
        pass

    def work_changed(self):
        pass

    def swaps_of(self, agent):
        from flexmarl.controller.train.allocator import SwapCount
        return SwapCount()

    @contextlib.asynccontextmanager
    async def holding(self, agent):
        trainer = await self.acquire(agent, lost="raise")
        try:
            yield trainer
        finally:
            self.release(agent)


class FakeTrainer:
    def __init__(self):
        self.log, self._id = [], 0

    def next_request_id(self):
        self._id += 1
        return self._id

    async def call(self, worker, msg, buffers=(), timeout=None, on_sent=None):
        if on_sent is not None:
            on_sent()
        if getattr(self, "dies_at", None) == len(self.log):  # the trainer dies, its agents' states with it
            from flexmarl.controller.control.server import WorkerDied
            self.dies_at, self.log[:] = None, self.log + [("died",)]
            self.allocator.lost["a"] = "t0"
            raise WorkerDied("t0", "killed")
        if isinstance(msg, protocol.TrainMicroBatch):
            self.sent_groups = getattr(self, "sent_groups", []) + list(msg.groups)
            samples = sorted(f"{g.key.call}/{j}" for g in msg.groups for j in range(len(g.lengths)))
            self.log.append(("train", samples))
            return protocol.MicroBatchDone(msg.request_id, msg.agent, 0.0, 3 * len(samples), 0.01), []
        self.log.append(("step", msg.version, msg.samples))
        self.step_samples = msg.samples
        stats = protocol.StepStats(loss=0.5, grad_norm=1.5, entropy=0.7, samples=msg.samples)
        return protocol.StepDone(msg.request_id, msg.agent, msg.version, 1.5, 0.01, stats), []


class FakeWeights:
    def __init__(self, schedule):
        self.schedule, self.synced = schedule, []

    async def sync(self, agent, trainer, version):
        self.synced.append(version)
        self.schedule.versions.set(agent, version)

    def forget(self, agent):
        self.forgotten = agent

    async def catch_up(self, agent, trainer, version):
        self.caught_up = version  # every instance already holds it here

    @contextlib.asynccontextmanager
    async def stepping(self, agent):
        self.forget(agent)
        yield


class FakeMetrics:
    def __init__(self):
        self.rows, self.ended = [], []

    def record(self, step, agent, version, trained, times, **extra):
        self.rows.append((step, sum(mb.samples for mb in trained)))
        self.extra = extra

    def end_step(self, step, total):
        self.ended.append(step)

    async def make_durable(self):
        self.durable = list(self.rows)


class FakeCheckpoints:
    def __init__(self, every, damaged=()):
        self.every, self.saved, self.full_state = every, [], True
        self.damaged = set(damaged)  # steps whose saved state no longer matches the manifest
        self.root = Path("/runs/r/checkpoints")

    def due(self, step):
        return step % self.every == 0

    async def save_agent(self, agent, trainer, step):
        self.saved.append(step)

    async def intact_state(self, agent, step):
        if step in self.damaged:
            raise DamagedFile(f"/runs/r/checkpoints/step-{step:06d}/{agent}/training_state.flexmarl",
                              "does not match its checksum")
        return f"state-{step}", ""


def make(mode, micro_batch=4, steps=1, episodes=1, checkpoints=None, allow_empty_steps=False):
    store = ExperienceStore(["a"])
    schedule = BatchSchedule(["a"], steps, episodes, overlap=mode == "async", max_staleness=0)
    store.on_ready.append(lambda k: schedule.work_arrived(k.agent))
    trainer, metrics, events = FakeTrainer(), FakeMetrics(), []
    weights = FakeWeights(schedule)

    async def flush():
        events.append("flushed")

    allocator = trainer.allocator = FakeAllocator()
    pipeline = AgentPipeline("a", PipelineConfig(mode=mode, micro_batch=micro_batch, queries_per_step=episodes,
                                                            allow_empty_steps=allow_empty_steps), store, schedule,
                             allocator, weights, trainer, metrics, events.append, flush, checkpoints=checkpoints)
    return pipeline, store, schedule, trainer, weights, metrics, events


def complete_group(store, call, n=2, batch=1):
    return filled(store, "a", call, [1.0] + [0.0] * (n - 1), batch, version=batch - 1)


async def test_async_micro_batches_train_while_rollout_runs_then_one_step_and_one_sync():
    pipeline, store, schedule, trainer, weights, metrics, events = make("async")
    task = asyncio.ensure_future(pipeline.run())
    complete_group(store, "g0")
    complete_group(store, "g1")
    await asyncio.sleep(0.05)
    assert trainer.log == [("train", ["g0/0", "g0/1", "g1/0", "g1/1"])]  # before the batch ended
    complete_group(store, "g2")
    schedule.episode_ended(1)
    await asyncio.wait_for(task, 2)
    assert trainer.log[1:] == [("train", ["g2/0", "g2/1"]), ("step", 1, 6)]
    assert weights.synced == [1] and schedule.versions["a"] == 1
    assert metrics.rows == [(1, 6)] and metrics.ended == [1] and pipeline.samples_trained == 6
    assert pipeline.tokens_trained == 18 and "flushed" in events
    assert store.ready_samples("a", 1) == 0


async def test_the_weight_sync_goes_out_while_the_log_is_flushed_and_the_step_ends_after_both():
    pipeline, store, schedule, trainer, weights, metrics, events = make("async")
    disk = asyncio.Event()

    async def slow_flush():  # a slow disk, or the other agents' flushes ahead of this one
        events.append("flush started")
        await disk.wait()
        events.append("flushed")

    pipeline.flush_events = slow_flush
    task = asyncio.ensure_future(pipeline.run())
    complete_group(store, "g0")
    schedule.episode_ended(1)
    for _ in range(50):
        await asyncio.sleep(0.01)
        if weights.synced:
            break
    assert weights.synced == [1] and schedule.versions["a"] == 1  # the gate opens without the disk
    assert "flush started" in events and "flushed" not in events
    assert metrics.rows == [] and not task.done()  # the step is not done: nothing that led to it is durable yet
    disk.set()
    await asyncio.wait_for(task, 2)
    assert events.index("flushed") > events.index("flush started") and metrics.rows == [(1, 2)]


async def test_a_group_wakes_its_resident_agents_pipeline_only_where_a_micro_batch_can_be_cut():
    pipeline, store, schedule, trainer, weights, metrics, events = make("async", micro_batch=6)
    store.on_ready[:] = [lambda k: pipeline.group_ready()]  # as the run wires it
    pipeline.allocator.resident["a"] = "t0"
    wakes = []
    woken = schedule.work_arrived
    schedule.work_arrived = lambda agent: (wakes.append(store.ready_samples(agent, 1)), woken(agent))
    task = asyncio.ensure_future(pipeline.run())
    await asyncio.sleep(0)
    for call in ("g0", "g1", "g2"):  # 2 samples each: the third makes a micro-batch of 6
        complete_group(store, call)
    assert wakes == [6]  # not at 2, 4 (nothing to cut): one task switch instead of three
    await asyncio.sleep(0.05)
    assert trainer.log == [("train", ["g0/0", "g0/1", "g1/0", "g1/1", "g2/0", "g2/1"])]
    complete_group(store, "g3")
    assert wakes == [6]
    schedule.episode_ended(1)  # the batch's end wakes it for the rest
    await asyncio.wait_for(task, 2)
    assert trainer.log[1:] == [("train", ["g3/0", "g3/1"]), ("step", 1, 8)]
    pipeline.allocator.resident.clear()  # not on a trainer: every group wakes it (a swap-in may start)
    assert pipeline.batch == 1
    complete_group(store, "h0", batch=1)
    assert wakes[-1] == 2


async def test_sync_mode_forms_micro_batches_only_after_the_batch_rollout_ended():
    pipeline, store, schedule, trainer, weights, metrics, events = make("sync")
    task = asyncio.ensure_future(pipeline.run())
    complete_group(store, "g0")
    complete_group(store, "g1")
    await asyncio.sleep(0.05)
    assert trainer.log == []
    schedule.episode_ended(1)
    await asyncio.wait_for(task, 2)
    assert [entry[0] for entry in trainer.log] == ["train", "step"]


async def test_a_batch_with_no_trainable_samples_steps_where_empty_steps_are_allowed():
    pipeline, store, schedule, trainer, weights, metrics, events = make("async", allow_empty_steps=True)
    task = asyncio.ensure_future(pipeline.run())
    schedule.episode_ended(1)
    await asyncio.wait_for(task, 2)
    assert trainer.log == [("step", 1, 0)] and weights.synced == [1]


async def test_an_agent_with_no_sample_in_a_step_stops_the_run_with_the_first_failure():
    pipeline, store, schedule, trainer, weights, metrics, events = make("async", episodes=3)
    task = asyncio.ensure_future(pipeline.run())
    schedule.episode_ended(1)
    schedule.episode_ended(1)
    schedule.episode_ended(1, "episode s1q2 failed: KeyError: 'question' (at /job/flow.py:3 in episode)")
    with pytest.raises(RunFailed, match=r"(?s)agent 'a' got no trainable sample in step 1: 1 of its episodes "
                                        r"failed.*/job/flow.py:3"):
        await asyncio.wait_for(task, 2)
    assert trainer.log == [] and weights.synced == []


async def test_a_step_with_too_many_failed_episodes_stops_the_run():
    pipeline, store, schedule, trainer, weights, metrics, events = make("async", episodes=2)
    task = asyncio.ensure_future(pipeline.run())
    schedule.episode_ended(1, "episode s1q0 failed: KeyError: 'question' (at /job/flow.py:3 in episode)")
    schedule.episode_ended(1, "episode s1q1 failed: KeyError: 'question' (at /job/flow.py:3 in episode)")
    with pytest.raises(RunFailed, match=r"(?s)2 of the 2 episodes of step 1 failed, more than "
                                        r"pipeline.max_failed_share = 0.5.*s1q0.*/job/flow.py:3"):
        await asyncio.wait_for(task, 2)


async def test_the_steps_failed_episodes_reach_the_metrics():
    pipeline, store, schedule, trainer, weights, metrics, events = make("async", episodes=2)
    task = asyncio.ensure_future(pipeline.run())
    complete_group(store, "g0")
    schedule.episode_ended(1)
    schedule.episode_ended(1, "episode s1q1 failed: ValueError: no")
    await asyncio.wait_for(task, 2)
    assert metrics.extra["episodes_failed"] == 1


async def test_the_step_states_its_sample_count_and_the_trainers_signals_reach_the_metrics():
    pipeline, store, schedule, trainer, weights, metrics, events = make("async")
    task = asyncio.ensure_future(pipeline.run())
    complete_group(store, "g0", n=3)
    g1 = key("g1")
    store.open_group(g1, [1], 2, 1)
    store.record_group(g1, output_of([[2], [3]], [[-0.5], [-0.5]]), TurnSampling(0, 0.7, 0.9, 5))
    store.set_group_rewards(g1, [1.0, 0.0])
    schedule.episode_ended(1)
    await asyncio.wait_for(task, 2)
    assert trainer.step_samples == 5
    sent = {g.key.call: (g.temperature, g.top_p, g.top_k) for g in trainer.sent_groups}
    assert sent == {"g0": (1.0, 1.0, 0), "g1": (0.7, 0.9, 5)}
    assert all(g.loss_mask == b"" for g in trainer.sent_groups)  # single-turn: every token trained
    assert (metrics.extra["loss"], metrics.extra["grad_norm"], metrics.extra["entropy"]) == (0.5, 1.5, 0.7)


async def test_a_dead_trainer_is_mended_from_the_last_saved_state_and_every_sample_is_trained_once_more():
    from flexmarl.controller.replay.lineage import lineage
    from flexmarl.runtime import events as ev

    checkpoints = FakeCheckpoints(every=2)
    pipeline, store, schedule, trainer, weights, metrics, events = make("sync", micro_batch=2, steps=3,
                                                                           checkpoints=checkpoints)
    task = asyncio.ensure_future(pipeline.run())
    for batch in (1, 2):
        complete_group(store, f"b{batch}g0", batch=batch)
        schedule.episode_ended(batch)
        await asyncio.sleep(0.02)
    assert checkpoints.saved == [2] and len(trainer.log) == 4  # (train, step) x 2
    trainer.dies_at = 5  # in batch 3, after its first micro-batch: that gradient is lost
    complete_group(store, "b3g0", batch=3)
    complete_group(store, "b3g1", batch=3)
    schedule.episode_ended(3)
    await asyncio.wait_for(task, 2)
    assert pipeline.allocator.recovered == [("a", "state-2", 2)]  # batch 2 was saved: nothing before to redo
    after = trainer.log[trainer.log.index(("died",)) + 1:]
    assert after == [("train", ["b3g0/0", "b3g0/1"]), ("train", ["b3g1/0", "b3g1/1"]), ("step", 3, 4)]
    assert pipeline.samples_trained == 2 + 2 + 4 and metrics.rows == [(1, 2), (2, 2), (3, 4)]
    # The checkpoint of step 2 is the first: what came before it (the initial weights) needs
    # nothing, so batches 1-3 are kept, should the state of step 2 be found damaged.
    assert [store.holds(key(call)) for call in ("b1g0", "b2g0", "b3g0", "b3g1")] == [True, True, True, True]
    assert sorted(pipeline.recovery.kept) == [1, 2, 3]
    restored = [e for e in events if isinstance(e, ev.TrainingRestored)]
    assert [(e.agent, e.version, e.batch) for e in restored] == [("a", 2, 3)]
    for i, e in enumerate(x for x in events if isinstance(x, ev.Event)):
        e.seq = i
    formed = [e.parts.samples() for e in lineage([x for x in events if isinstance(x, ev.Event)])
              if isinstance(e, ev.MicroBatchFormed)]
    ids = [sid for mb in formed for sid in mb]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 8  # each sample once in what counts


async def test_a_damaged_saved_state_is_passed_over_for_the_one_before_and_the_batches_since_are_trained_again(caplog):
    checkpoints = FakeCheckpoints(every=2, damaged={4})
    pipeline, store, schedule, trainer, weights, metrics, events = make("sync", micro_batch=2, steps=5,
                                                                           checkpoints=checkpoints)
    task = asyncio.ensure_future(pipeline.run())
    for batch in (1, 2, 3, 4):
        complete_group(store, f"b{batch}g0", batch=batch)
        schedule.episode_ended(batch)
        await asyncio.sleep(0.02)
    assert checkpoints.saved == [2, 4]
    # Held: the groups of the batches since the state before the last.
    assert [store.holds(key(f"b{b}g0")) for b in (1, 2, 3, 4)] == [False, False, True, True]
    trainer.dies_at = len(trainer.log) + 1  # in batch 5: its trainer is gone
    complete_group(store, "b5g0", batch=5)
    schedule.episode_ended(5)
    await asyncio.wait_for(task, 2)
    assert pipeline.allocator.recovered == [("a", "state-2", 2)]
    after = trainer.log[trainer.log.index(("died",)) + 1:]
    assert after == [("train", ["b3g0/0", "b3g0/1"]), ("step", 3, 2), ("train", ["b4g0/0", "b4g0/1"]),
                     ("step", 4, 2), ("train", ["b5g0/0", "b5g0/1"]), ("step", 5, 2)]
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert said == ["a: the checkpoint of step 4 is damaged and is not restored from: /runs/r/checkpoints/step-000004/a/"
                    "training_state.flexmarl does not match its checksum; restoring from the checkpoint of step 2 "
                    "instead, the newest intact one"]
    from flexmarl.runtime import events as ev
    assert [(e.version, e.batch) for e in events if isinstance(e, ev.TrainingRestored)] == [(2, 5)]


async def test_a_damaged_saved_state_with_none_before_it_at_hand_stops_the_run_with_the_resume_command():
    checkpoints = FakeCheckpoints(every=1, damaged={2, 3})
    pipeline, store, schedule, trainer, weights, metrics, events = make("sync", micro_batch=2, steps=4,
                                                                           checkpoints=checkpoints)
    task = asyncio.ensure_future(pipeline.run())
    for batch in (1, 2, 3):
        complete_group(store, f"b{batch}g0", batch=batch)
        schedule.episode_ended(batch)
        await asyncio.sleep(0.02)
    trainer.dies_at = len(trainer.log) + 1
    complete_group(store, "b4g0", batch=4)
    schedule.episode_ended(4)
    with pytest.raises(RunFailed) as failed:
        await asyncio.wait_for(task, 2)
    assert str(failed.value).startswith("a's trainer died and neither its saved training state of step 3 (")
    assert str(failed.value).endswith("nor that of step 2 (/runs/r/checkpoints/step-000002/a/training_state.flexmarl "
                                      "does not match its checksum) can be restored. `flexmarl run --resume /runs/r` "
                                      "starts from the newest intact checkpoint")


async def test_batches_since_the_last_saved_state_are_trained_again_in_the_same_micro_batches():
    checkpoints = FakeCheckpoints(every=10)  # nothing saved: back to the initial weights
    pipeline, store, schedule, trainer, weights, metrics, events = make("async", micro_batch=2, steps=2,
                                                                         checkpoints=checkpoints)
    task = asyncio.ensure_future(pipeline.run())
    complete_group(store, "b1g0", batch=1)
    schedule.episode_ended(1)
    await asyncio.sleep(0.02)
    trainer.dies_at = len(trainer.log) + 1  # batch 2's step fails: its trainer is gone
    complete_group(store, "b2g0", batch=2)
    schedule.episode_ended(2)
    await asyncio.wait_for(task, 2)
    assert pipeline.allocator.recovered == [("a", None, 0)]
    after = trainer.log[trainer.log.index(("died",)) + 1:]
    assert after == [("train", ["b1g0/0", "b1g0/1"]), ("step", 1, 2),
                     ("train", ["b2g0/0", "b2g0/1"]), ("step", 2, 2)]
    assert weights.synced == [1, 2] and pipeline.samples_trained == 4


async def test_steps_with_a_non_finite_gradient_are_logged_counted_and_end_the_run_after_too_many_in_a_row():
    from flexmarl.runtime import events as ev

    pipeline, store, schedule, trainer, weights, metrics, events = make("sync", steps=4)
    pipeline.cfg.max_skipped_steps = 2
    skip_at = {2, 3}
    plain_call = trainer.call

    async def call(worker, msg, buffers=(), timeout=None, on_sent=None):
        reply, frames = await plain_call(worker, msg, buffers, timeout, on_sent)
        if isinstance(msg, protocol.OptimStep) and msg.version in skip_at:
            reply.stats.skipped, reply.stats.grad_norm = True, float("inf")
        return reply, frames

    trainer.call = call
    task = asyncio.ensure_future(pipeline.run())
    for batch in (1, 2, 3, 4):
        complete_group(store, f"b{batch}g0", batch=batch)
        schedule.episode_ended(batch)
    with pytest.raises(RuntimeError, match="2 optimizer steps in a row had a non-finite gradient"):
        await asyncio.wait_for(task, 2)
    skipped = [e for e in events if isinstance(e, ev.StepSkipped)]
    assert [(e.version, e.in_a_row) for e in skipped] == [(2, 1), (3, 2)]
    assert metrics.rows == [(1, 2), (2, 2)]  # step 3 ended the run before its row
    assert metrics.extra["skipped"] == 1 and metrics.extra["skipped_steps"] == 1
    assert weights.synced == [1, 2]  # version 2 (the weights of 1, finite) still reached the gate


async def test_a_crash_right_after_a_checkpoint_loses_no_metrics_row():
    class Crash(Exception):
        pass

    class CrashAfterSave(FakeCheckpoints):
        async def save_agent(self, agent, trainer, step):
            await super().save_agent(agent, trainer, step)
            raise Crash(f"the controller dies right after checkpoint {step} is final")

    checkpoints = CrashAfterSave(every=2)
    pipeline, store, schedule, trainer, weights, metrics, events = make("sync", steps=3, checkpoints=checkpoints)
    task = asyncio.ensure_future(pipeline.run())
    for batch in (1, 2, 3):
        complete_group(store, f"b{batch}g0", batch=batch)
        schedule.episode_ended(batch)
    with pytest.raises(Crash):
        await asyncio.wait_for(task, 2)
    assert checkpoints.saved == [2]
    # a resume continues at step 3: rows 1 and 2 were already durable when 2 became final
    assert metrics.durable == metrics.rows == [(1, 2), (2, 2)]


async def test_an_agent_whose_trainer_died_while_it_waits_for_samples_is_restored_at_once():
    checkpoints = FakeCheckpoints(every=1)
    pipeline, store, schedule, trainer, weights, metrics, events = make("sync", micro_batch=2, steps=2,
                                                                           checkpoints=checkpoints)
    task = asyncio.ensure_future(pipeline.run())
    complete_group(store, "b1g0", batch=1)
    schedule.episode_ended(1)
    await asyncio.sleep(0.02)
    assert checkpoints.saved == [1] and pipeline.allocator.recovered == []  # waiting for batch 2's samples
    pipeline.allocator.lost["a"] = "t0"  # its trainer died meanwhile (what TrainingRun tells the allocator)
    schedule.work_arrived("a")  # ... and wakes the pipeline with
    await asyncio.sleep(0.02)
    assert pipeline.allocator.recovered == [("a", "state-1", 1)]  # before any sample of batch 2 came
    complete_group(store, "b2g0", batch=2)
    schedule.episode_ended(2)
    await asyncio.wait_for(task, 2)
    assert metrics.rows == [(1, 2), (2, 2)]
