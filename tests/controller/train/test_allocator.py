import asyncio
import contextlib

import pytest

from flexmarl.controller.state.decisions import AgentWork, choose_placement
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol as p

TRAINERS = ["t0", "t1"]


def test_free_slot_goes_to_the_least_loaded_trainer():
    assert choose_placement("c", TRAINERS, 2, {"a": "t0"}, {}, {}, {}) == ("t1", None)


def test_unlimited_capacity_never_parks_anyone():
    resident = {"a": "t0", "b": "t1", "c": "t0"}
    assert choose_placement("d", TRAINERS, 0, resident, {}, {}, {}) == ("t1", None)


def test_full_pool_parks_the_idle_agent_with_the_fewest_samples_coming():
    resident = {"a": "t0", "b": "t1"}
    work = {"a": AgentWork(coming=5), "b": AgentWork(coming=1)}
    assert choose_placement("c", TRAINERS, 1, resident, {}, work, {}) == ("t1", "b")


def test_an_agent_with_work_in_flight_or_ready_is_never_parked():
    resident = {"a": "t0", "b": "t1"}
    assert choose_placement("c", TRAINERS, 1, resident, {"b": 1}, {}, {}) == ("t0", "a")
    assert choose_placement("c", TRAINERS, 1, resident, {"a": 1, "b": 2}, {}, {}) is None
    ready = {"a": AgentWork(ready=4), "b": AgentWork(ready=1)}  # micro-batches formed, or a step due
    assert choose_placement("c", TRAINERS, 1, resident, {}, ready, {}) is None


def test_a_prefetch_parks_nobody_with_samples_coming_so_residents_never_swap_back_and_forth():
    resident = {"a": "t0"}
    coming = {"a": AgentWork(coming=2), "c": AgentWork(coming=8)}
    assert choose_placement("c", ["t0"], 1, resident, {}, coming, {}) == ("t0", "a")  # work waits for c
    assert choose_placement("c", ["t0"], 1, resident, {}, coming, {}, prefetch=True) is None
    assert choose_placement("c", ["t0"], 1, resident, {}, {"c": AgentWork(coming=8)}, {},
                            prefetch=True) == ("t0", "a")  # a has nothing coming: c's work is first


def test_ties_go_to_the_longest_unused_agent():
    resident = {"a": "t0", "b": "t1"}
    assert choose_placement("c", TRAINERS, 1, resident, {}, {}, {"a": 10.0, "b": 5.0}) == ("t1", "b")


# --- trainers dying during swaps (a fake for the other side of the sockets) -------------


class FakeTrainers:
    """Answers the allocator's commands like trainers would; `die` maps (trainer, command
    name) to a death: that call raises WorkerDied, as the server does for a dead worker."""

    def __init__(self, die=()):
        import itertools

        self.die, self.calls, self._ids = set(die), [], itertools.count(1)
        self.messages = []  # (trainer, message), every call

    def next_request_id(self):
        return next(self._ids)

    async def call(self, worker, msg):
        from flexmarl.controller.control.server import WorkerDied
        from flexmarl.runtime import protocol as p

        name = type(msg).__name__
        self.calls.append((worker, name, getattr(msg, "handle", None)))
        self.messages.append((worker, msg))
        if (worker, name) in self.die:
            raise WorkerDied(worker, "killed")
        if isinstance(msg, p.OffloadAgent):
            return p.AgentOffloaded(msg.request_id, msg.agent, 3, 0, f"parked-{msg.agent}".encode(), 100, 0.0,
                                    [f"shard-{msg.agent}-{r}".encode() for r in (1, 2)]), []
        if isinstance(msg, p.ReleaseState):
            return p.StateReleased(msg.request_id, msg.agent), []
        return p.AgentReady(msg.request_id, msg.agent, getattr(msg, "version", 0), 10), []


def make_allocator(server, trainers, capacity=1):
    from flexmarl.controller.train.allocator import TrainerAllocator
    from flexmarl.runtime.config import AgentConfig

    cfg = {a: AgentConfig(lr=1e-3, max_grad_norm=1.0) for a in ("a", "b", "c")}
    events = []
    alloc = TrainerAllocator(server, trainers, capacity, cfg, {a: f"/models/{a}" for a in cfg}, 0,
                             lambda a: AgentWork(), events.append)
    return alloc, events


async def place(alloc, agent):
    trainer = await alloc.acquire(agent)
    alloc.release(agent)
    return trainer


async def test_a_trainer_dying_while_loading_leaves_the_parked_copy_as_owner_and_another_trainer_loads_it():
    server = FakeTrainers(die={("t1", "LoadAgent")})
    alloc, events = make_allocator(server, ["t0", "t1"])
    await place(alloc, "a")  # t0
    await place(alloc, "b")  # t1
    alloc.last_used.update(a=2.0, b=1.0)
    # c needs a slot: b (longest unused) is parked off t1; c is initialised there.
    assert await place(alloc, "c") == "t1"
    assert alloc.parked["b"].holder == "t1"
    # b comes back: c is parked off t1 and t1 dies loading b.
    alloc.last_used.update(a=5.0, c=1.0)
    server.die.add(("t1", "LoadAgent"))
    trainer = await place(alloc, "b")
    assert trainer == "t0" and alloc.trainers == ["t0"]
    loads = [(w, h) for w, name, h in server.calls if name == "LoadAgent" and h == b"parked-b"]
    assert loads == [("t1", b"parked-b"), ("t0", b"parked-b")]  # the same kept copy, twice
    # The copy was released only after the live trainer had loaded it.
    released = [i for i, (w, name, h) in enumerate(server.calls) if name == "ReleaseState" and h == b"parked-b"]
    assert len(released) == 1 and released[0] > server.calls.index(("t0", "LoadAgent", b"parked-b"))
    assert any("died while loading" in e.why for e in events if isinstance(e, ev.AllocationChanged))


async def test_a_swap_in_that_meets_a_dead_trainer_during_shutdown_raises_instead_of_retrying_forever():
    import pytest

    from flexmarl.controller.control.server import WorkerDied

    server = FakeTrainers()
    alloc, events = make_allocator(server, ["t0"])
    await place(alloc, "a")
    await place(alloc, "b")  # a parked off t0
    server.closing = True  # shutdown was sent: trainers leaving no longer shrink the pool
    server.die.add(("t0", "LoadAgent"))
    real_emit, emitted = alloc.emit, []

    def emit(event):  # a retry loop never yields to the event loop: stop it by its events
        emitted.append(event)
        if len(emitted) > 100:
            raise AssertionError("the allocator retried the swap-in without end")
        real_emit(event)

    alloc.emit = emit
    with pytest.raises(WorkerDied):
        await alloc.acquire("a")
    assert [name for _, name, _ in server.calls].count("LoadAgent") == 1  # tried once, not again


async def test_a_dead_holder_of_a_parked_copy_does_not_fail_a_swap_that_already_loaded_it():
    server = FakeTrainers()
    alloc, _ = make_allocator(server, ["t0", "t1"])
    await place(alloc, "a")
    await place(alloc, "b")
    alloc.last_used.update(a=2.0, b=1.0)
    await place(alloc, "c")  # parks b with t1
    server.die.add(("t1", "ReleaseState"))
    alloc.last_used.update(a=1.0, c=5.0)
    assert await place(alloc, "b") == "t0"  # parks a off t0, loads b there; t1's release fails
    assert "b" not in alloc.parked and alloc.resident["b"] == "t0"


async def test_states_resident_on_a_dead_trainer_are_lost_until_recovered_never_silently_reinitialised():
    import asyncio

    import pytest

    from flexmarl.controller.train.allocator import AgentLost

    server = FakeTrainers()
    alloc, _ = make_allocator(server, ["t0", "t1"])
    alloc.trainer_wait_s = 0.2
    await place(alloc, "a")
    await place(alloc, "b")
    assert alloc.trainer_died("t1") == ["b"]
    with pytest.raises(AgentLost, match="training state of b died with trainer t1"):
        await alloc.acquire("b", lost="raise")  # its pipeline, which restores it
    waiting = asyncio.create_task(alloc.acquire("b"))  # anyone else waits for that
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert not any(name == "InitAgent" and w == "t0" and "b" in str(h) for w, name, h in server.calls[2:])
    alloc.trainer_died("t0")
    with pytest.raises(RuntimeError, match="no trainer is left.*none joined within"):
        await alloc.acquire("c")
    waiting.cancel()


async def test_a_recovered_agent_loads_its_saved_state_on_a_trainer_that_joined_and_the_file_stays():
    import asyncio

    from flexmarl.runtime.params.types import Location, ParamHandle

    server = FakeTrainers()
    alloc, events = make_allocator(server, ["t0"])
    await place(alloc, "a")
    alloc.trainer_died("t0")
    saved = ParamHandle(transport="disk", agent="a", version=4, key="k", layout=[], total_bytes=10, checksum=0,
                        publisher=Location("h", 1), path="/run/checkpoints/step-000004/a/training_state.flexmarl")
    alloc.recover("a", saved, 4)
    acquired = asyncio.create_task(place(alloc, "a"))  # waits: no trainer in the pool
    await asyncio.sleep(0.05)
    assert not acquired.done()
    alloc.trainer_joined("t0")  # restarted by the launcher under its old id
    assert await acquired == "t0"
    assert server.calls[-1][:2] == ("t0", "LoadAgent") and server.calls[-1][2] is saved
    assert not any(name == "ReleaseState" for _, name, _ in server.calls)  # a checkpoint is never released
    alloc.trainer_died("t0")
    alloc.trainer_joined("t1")
    alloc.recover("a", None, 0)  # nothing saved yet: initialised afresh from its model
    assert await place(alloc, "a") == "t1" and server.calls[-1][:2] == ("t1", "InitAgent")


async def test_a_trainer_back_in_the_pool_is_placed_on_again():
    server = FakeTrainers()
    alloc, _ = make_allocator(server, ["t0", "t1"])
    alloc.trainer_died("t1")  # nothing was resident on it
    alloc.trainer_joined("t1")
    alloc.trainer_joined("t1")  # a second notice changes nothing
    assert alloc.trainers == ["t0", "t1"]
    assert {await place(alloc, "a"), await place(alloc, "b")} == {"t0", "t1"}  # one slot each


async def test_agents_are_placed_with_their_precision_and_a_groups_shards_travel_with_the_swap():
    from flexmarl.runtime import protocol as p

    server = FakeTrainers()
    alloc, _ = make_allocator(server, ["t0", "t1"])
    alloc.specs.config["b"].dtype, alloc.specs.config["b"].activation_checkpointing = "bfloat16", True
    await place(alloc, "a")  # t0
    await place(alloc, "b")  # t1, initialised with its precision
    alloc.last_used.update(a=1.0, b=2.0)
    await place(alloc, "c")  # a is parked off t0 (its group's three shards), c initialised there
    alloc.last_used.update(b=1.0, c=2.0)
    assert await place(alloc, "a") == "t1"  # and a comes back on t1: t0 releases its copy
    by_type = {}
    for _, msg in server.messages:
        by_type.setdefault(type(msg).__name__, []).append(msg)
    init_b = next(m for m in by_type["InitAgent"] if m.agent == "b")
    assert init_b.settings == p.TrainerSettings("bfloat16", "mixed", True)
    (load_a,) = by_type["LoadAgent"]
    assert load_a.settings == p.TrainerSettings() and load_a.shards == [b"shard-a-1", b"shard-a-2"]
    release_a = next(m for m in by_type["ReleaseState"] if m.agent == "a")
    assert release_a.handle == b"parked-a" and release_a.shards == [b"shard-a-1", b"shard-a-2"]


# --- two agents sharing one trainer slot, driven by their real pipelines ----------------


class OneTrainer:
    """One trainer as the allocator and pipelines drive it: it refuses work for an agent that
    is not resident (and a save of one it does not hold), counts what it is sent, and
    replies only after the event loop has run other tasks, as a real one replies later."""

    def __init__(self, turns=3):
        import itertools

        self.resident, self.parked, self.sent, self._ids = set(), set(), [], itertools.count(1)
        self.turns = turns  # loop turns before a reply: 0 replies before anything else runs

    def next_request_id(self):
        return next(self._ids)

    async def call(self, worker, msg, buffers=(), timeout=None, on_sent=None):
        if on_sent is not None:
            on_sent()
        for _ in range(self.turns):
            await asyncio.sleep(0)
        self.sent.append((type(msg).__name__, msg.agent))
        agent, rid = msg.agent, msg.request_id
        if isinstance(msg, (p.InitAgent, p.LoadAgent)):
            assert agent not in self.resident
            self.parked.discard(agent)
            self.resident.add(agent)
            return p.AgentReady(rid, agent, getattr(msg, "version", 0), 10), []
        if isinstance(msg, p.OffloadAgent):
            self.resident.remove(agent)
            self.parked.add(agent)
            return p.AgentOffloaded(rid, agent, 0, 0, f"parked-{agent}".encode(), 100, 0.0), []
        if isinstance(msg, p.SaveCheckpoint):
            assert agent in self.resident | self.parked
            return p.CheckpointSaved(rid, agent, msg.path, 1), []
        if isinstance(msg, p.ReleaseState):
            return p.StateReleased(rid, agent), []
        assert agent in self.resident, f"{type(msg).__name__} for {agent}, which is not resident"
        if isinstance(msg, p.TrainMicroBatch):
            return p.MicroBatchDone(rid, agent, 0.0, 3 * sum(len(g.lengths) for g in msg.groups), 0.01), []
        return p.StepDone(rid, agent, msg.version, 1.0, 0.01, p.StepStats(samples=msg.samples)), []

    def loads(self, agent):
        return self.sent.count(("LoadAgent", agent))


class Saves:
    """The checkpointer's side: every step is due, each save a SaveCheckpoint to the trainer named."""

    full_state = True

    def __init__(self, server):
        self.server = server

    def due(self, step):
        return True

    async def save_agent(self, agent, trainer, step):
        await self.server.call(trainer, p.SaveCheckpoint(self.server.next_request_id(), agent, f"/ck/{agent}", True))


def two_agents_on_one_trainer(mode="sync", turns=3):
    from flexmarl.controller.state.schedule import BatchSchedule
    from flexmarl.controller.state.store import ExperienceStore
    from flexmarl.controller.train.allocator import TrainerAllocator
    from flexmarl.controller.train.pipeline import AgentPipeline
    from flexmarl.controller.train.trainer_lanes import TrainerLanes
    from flexmarl.runtime.config import AgentConfig, PipelineConfig

    agents = ["a", "b"]
    store = ExperienceStore(agents)
    schedule = BatchSchedule(agents, 1, 2, overlap=mode == "async", max_staleness=0)
    store.on_ready.append(lambda k: schedule.work_arrived(k.agent))
    server, events = OneTrainer(turns), []
    pipelines = {}
    alloc = TrainerAllocator(server, ["t0"], 1, {a: AgentConfig() for a in agents}, {a: f"/m/{a}" for a in agents},
                             0, lambda a: pipelines[a].work(), events.append)

    class Weights:
        async def sync(self, agent, trainer, version):
            assert agent in server.resident  # the publish reads the resident state
            schedule.versions.set(agent, version)

        @contextlib.asynccontextmanager
        async def stepping(self, agent):
            yield

    class Metrics:
        rows = []

        def record(self, step, agent, version, samples, times, **extra):
            self.rows.append((agent, extra))

        def end_step(self, step, total):
            pass

        async def make_durable(self):
            pass

    async def flush():
        pass

    lanes, metrics = TrainerLanes(), Metrics()
    for a in agents:
        pipelines[a] = AgentPipeline(a, PipelineConfig(mode=mode, micro_batch=2, queries_per_step=2), store,
                                     schedule, alloc, Weights(), server, metrics, events.append, flush,
                                     checkpoints=Saves(server), lanes=lanes)
    return alloc, pipelines, store, schedule, server, metrics


def episode(store, schedule, n):
    """One episode: a's group, then b's (as in a chain), then the episode ends."""
    from store_fill import filled

    for agent in ("a", "b"):
        filled(store, agent, f"{agent}{n}", [1.0, 1.0])
    schedule.episode_ended(1)


@pytest.mark.parametrize("turns", [0, 3])
async def test_capacity_one_two_agents_one_sync_step_swaps_each_agent_in_at_most_once(turns):
    alloc, pipelines, store, schedule, server, metrics = two_agents_on_one_trainer(turns=turns)
    for agent in ("a", "b"):  # set-up, as the training run places them: b parks a
        await alloc.acquire(agent)
        alloc.release(agent)
    set_up = len(server.sent)
    runs = [asyncio.ensure_future(pl.run()) for pl in pipelines.values()]
    episode(store, schedule, 0)
    await asyncio.sleep(0.01)  # rollout goes on: a prefetch may bring in whoever trains first
    episode(store, schedule, 1)
    await asyncio.wait_for(asyncio.gather(*runs), 5)
    loads = {agent: server.sent[set_up:].count(("LoadAgent", agent)) for agent in ("a", "b")}
    assert all(n <= 1 for n in loads.values()), f"swap-ins in one step: {loads}; commands: {server.sent[set_up:]}"
    assert sum(loads.values()) >= 1  # one slot, two agents: one of them comes in
    # Each agent's metrics row counts its swap-ins.
    assert {agent: extra["swap_ins"] for agent, extra in metrics.rows} == loads
    assert all(extra["swap_wait_s"] >= 0 for _, extra in metrics.rows)


async def test_a_checkpoint_of_a_parked_agent_is_written_from_its_parked_copy_without_a_swap_in():
    alloc, pipelines, store, schedule, server, metrics = two_agents_on_one_trainer()
    for agent in ("a", "b"):  # b's initialisation parks a
        await alloc.acquire(agent)
        alloc.release(agent)
    assert server.parked == {"a"}
    sent = len(server.sent)
    await pipelines["a"]._checkpoint(0)
    assert server.sent[sent:] == [("SaveCheckpoint", "a")]  # to the trainer holding the copy; nothing moved
    assert server.parked == {"a"} and alloc.resident == {"b": "t0"}


async def test_a_parked_agents_checkpoint_is_written_elsewhere_when_the_trainer_keeping_its_copy_is_gone():
    server = FakeTrainers()
    alloc, _ = make_allocator(server, ["t0", "t1"])
    await place(alloc, "a")  # t0
    await place(alloc, "b")  # t1
    alloc.last_used.update(a=1.0, b=2.0)
    await place(alloc, "c")  # a is parked with t0
    alloc.trainer_died("t0")  # c's state died with it; a's parked copy is still readable where it was
    async with alloc.holding("a") as trainer:
        assert trainer == "t1"  # not the dead holder: swapped in on a live trainer for the save
    assert ("t1", "LoadAgent", b"parked-a") in server.calls
