"""Carrying out level 1 moves with the instances' owner and its admission over a fake
server: leave, drain, restart or swap in place, join between syncs; a worker that dies or
refuses fails its move alone; the loop's log re-drives to the same moves."""

import asyncio
import contextlib
import types

import pytest

from fake_rollout import FakeServer, until

from flexmarl.controller.control.registry import WorkerInfo
from flexmarl.controller.control.server import RemoteError, WorkerDied
from flexmarl.controller.rollout.admission import Admission
from flexmarl.controller.rollout.balance_loop import Rebalancer, same_architecture
from flexmarl.controller.rollout.router import RolloutClient
from flexmarl.controller.state.instances import RolloutInstances
from flexmarl.controller.state.versions import SyncedVersions
from flexmarl.controller.weights.sync import Publication, WeightSync
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey
from flexmarl.runtime.bases import whole_models
from flexmarl.runtime.config import RouterConfig

# ---------------------------------------------------------------- carrying out a move


class FakeRun:
    """A Rebalancer handed what it uses (the instances' owner and its admission, a real
    WeightSync), over a FakeServer whose workers answer LoadModel and LoadWeights at once
    and, like the rollout worker, serve the agent they loaded last: another agent's weights
    load in place when the two agents' models have the same architecture (`same_model`),
    else they are refused."""

    def __init__(self, tmp_path, assignment: dict[str, list[str]], same_model: bool = False) -> None:
        workers = [w for ws in assignment.values() for w in ws]
        self.server = FakeServer(workers)
        self.server.calls = []
        self.serving = {w: a for a, ws in assignment.items() for w in ws}

        async def call(worker, msg, buffers=(), timeout=None):
            self.server.calls.append((worker, msg))
            if worker in self.dies:
                raise WorkerDied(worker, "killed by the test")
            if isinstance(msg, protocol.LoadWeights) and msg.agent != self.serving[worker] and (
                    worker in self.refuses_swaps
                    or not same_architecture(self.model_path[msg.agent], self.model_path[self.serving[worker]])):
                raise RemoteError(f"{worker}: weights for {msg.agent} sent to an instance serving "
                                  f"{self.serving[worker]}")
            if isinstance(msg, (protocol.LoadModel, protocol.LoadWeights)):
                self.serving[worker] = msg.agent
            if isinstance(msg, protocol.PublishWeights):
                version = self.versions[msg.agent] if msg.version == protocol.CURRENT_VERSION else msg.version
                return protocol.WeightsPublished(msg.request_id, msg.agent, version,
                                                 f"republished-{msg.agent}{version}", 1, 0.0), []
            return msg, []

        self.dies: set[str] = set()
        self.refuses_swaps: set[str] = set()  # workers whose engine takes no other agent's weights
        self.server.call = call
        self.events: list = []
        self.instances = RolloutInstances(whole_models(list(assignment)), self.emit)
        for agent, ws in assignment.items():
            for w in ws:
                self.instances.engine_started(w, agent, 0)
                self.instances.serve(w, agent, "placed by the test")
        self.events.clear()
        self.server.on_died.append(lambda info: self.instances.died(info.worker_id))
        self.client = RolloutClient(self.server, self.instances)
        self.model_path = {}
        for a in assignment:
            d = tmp_path / a
            d.mkdir()
            d.joinpath("config.json").write_text('{"hidden_size": %d}' % (64 if same_model else ord(a[0])))
            self.model_path[a] = str(d)
        self.versions = SyncedVersions(list(assignment))
        self.weights = WeightSync(list(assignment), self.server, self.instances, self.versions, self.emit,
                                  trainer_for=self.trainer_for)
        self.admission = Admission(self.instances, self.weights, self.versions, self.server,
                                   lambda a: protocol.LoadModel(1, a, self.model_path[a], 0))
        self.server.registry.workers["t0"] = WorkerInfo("t0", b"t0", "trainer", "host", 2, [], {}, 0.0)
        self.sync_lock = self.weights.locks
        self.rebalancer = Rebalancer(RouterConfig(), whole_models(list(assignment)), self.instances, self.admission,
                                     self.client, self.server, self.weights, self.model_path, self.emit, lambda: False)
        self.reassignments = self.rebalancer.reassignments

    def synced(self, agent: str, version: int, handle) -> None:
        """`agent` synced `version` (every instance serving it holds it), published as `handle`."""
        self.versions.set(agent, version)
        self.weights.published[agent] = Publication(version, handle, "shm")
        for w in self.instances.instances(agent):
            self.instances.loaded(w, agent, version)

    def emit(self, event) -> None:
        self.events.append(event)

    @contextlib.asynccontextmanager
    async def trainer_for(self, agent):
        yield "t0"

    def sent(self) -> list[tuple[str, str, str, int]]:
        return [(w, type(m).__name__, m.agent, m.version) for w, m in self.server.calls]


def reassign(run: FakeRun, worker: str, src: str, dst: str, **kw):
    return run.rebalancer.reassign(worker, src, dst, **kw)


async def test_a_moved_instance_restarts_on_the_new_agents_model_and_loads_its_synced_weights(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]})
    run.synced("b", 3, b"handle-b3")
    done = await reassign(run, "r0", "a", "b")
    assert done is not None and done.restarted
    assert run.sent() == [("r0", "LoadModel", "b", 0), ("r0", "LoadWeights", "b", 3)]
    assert run.server.calls[1][1].handle == b"handle-b3"
    assert run.instances.assignment == {"a": ["r1"], "b": ["r2", "r0"]} and run.instances.holds("r0", "b") == 3
    changes = [(e.agent, e.workers) for e in run.events if isinstance(e, ev.AllocationChanged)]
    assert changes == [("a", ["r1"]), ("b", ["r2", "r0"])]
    assert "joins from a" in run.events[-1].why and run.reassignments == [done]


def slow_loads(run: FakeRun, seconds: float, kind: type = protocol.LoadWeights) -> dict[str, int]:
    """Each message of `kind` answered after `seconds`; how many were in flight at most."""
    answer, seen = run.server.call, {"now": 0, "most": 0}

    async def call(worker, msg, buffers=(), timeout=None):
        if not isinstance(msg, kind):
            return await answer(worker, msg, buffers, timeout)
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            await asyncio.sleep(seconds)
            return await answer(worker, msg, buffers, timeout)
        finally:
            seen["now"] -= 1

    run.server.call = call
    return seen


async def test_instances_moved_together_load_the_new_agents_weights_side_by_side_under_one_hold_of_its_lock(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1", "r2", "r3"], "b": ["r4"]})
    run.synced("b", 3, b"handle-b3")
    seen = slow_loads(run, 0.2)
    done = await run.rebalancer.reassign_together(["r0", "r1", "r2"], "a", "b", "a test")
    assert seen["most"] == 3  # all three loading at once (one after another: one at a time)
    assert [d.worker for d in done] == ["r0", "r1", "r2"] and all(d.restarted for d in done)
    assert run.instances.assignment == {"a": ["r3"], "b": ["r4", "r0", "r1", "r2"]}
    assert all(run.instances.holds(w, "b") == 3 for w in ("r0", "r1", "r2"))
    assert sorted(run.sent()) == sorted([(w, k, "b", v) for w in ("r0", "r1", "r2")
                                         for k, v in (("LoadModel", 0), ("LoadWeights", 3))])


async def test_instances_moved_together_to_an_agent_at_version_zero_start_their_engines_side_by_side(tmp_path):
    # the same architecture: no restart asked, but version 0 is the model directory's weights
    run = FakeRun(tmp_path, {"a": ["r0", "r1", "r2", "r3"], "b": ["r4"]}, same_model=True)
    seen = slow_loads(run, 0.2, protocol.LoadModel)
    done = await run.rebalancer.reassign_together(["r0", "r1", "r2"], "a", "b")
    assert seen["most"] == 3 and all(d is not None for d in done)
    assert sorted(run.sent()) == [(w, "LoadModel", "b", 0) for w in ("r0", "r1", "r2")]


async def test_instances_moved_together_load_one_after_another_where_each_needs_a_publication_of_its_own(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1", "r2"], "b": ["r3"]})
    run.synced("b", 2, b"handle-b2")
    run.weights.published["b"] = Publication(2, b"handle-b2", "nccl")  # a broadcast: read once, by its ranks
    seen = slow_loads(run, 0.05)
    done = await run.rebalancer.reassign_together(["r0", "r1"], "a", "b")
    assert seen["most"] == 1 and all(d is not None for d in done)
    republished = [w for w, m in run.server.calls if isinstance(m, protocol.PublishWeights)]
    assert republished == ["t0", "t0"]  # one one-shot broadcast for each joining instance


async def test_of_instances_moved_together_one_that_dies_fails_its_move_alone(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1", "r2"], "b": ["r3"]})
    run.synced("b", 1, b"h1")
    run.dies.add("r1")
    done = await run.rebalancer.reassign_together(["r0", "r1"], "a", "b")
    assert done[0] is not None and done[1] is None
    assert run.instances.assignment["b"] == ["r3", "r0"] and "r1" not in run.instances.assignment["b"]
    assert [r.worker for r in run.reassignments] == ["r0"]


async def test_one_engine_message_is_not_sent_to_several_workers(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1", "r2"], "b": ["r3"]})
    with pytest.raises(ValueError, match="each start needs its own request"):
        await run.admission.admit_together(["r0", "r1"], "b", engine=protocol.LoadModel(7, "b", run.model_path["b"], 0))
    assert run.sent() == []


async def test_an_instance_joining_an_agent_still_at_version_zero_only_loads_the_model(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]})
    await reassign(run, "r1", "a", "b")
    assert run.sent() == [("r1", "LoadModel", "b", 0)]


async def test_a_move_waits_until_the_instances_outstanding_work_drains(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]})
    run.instances.add_work("r0", 40.0)
    task = asyncio.ensure_future(reassign(run, "r0", "a", "b"))
    await asyncio.sleep(0.2)
    assert run.sent() == [] and run.instances.assignment["a"] == ["r1"]  # left a, not loaded yet
    run.instances.work_done("r0", 40.0)
    assert (await task) is not None and run.instances.assignment["b"] == ["r2", "r0"]


async def test_an_instance_that_does_not_drain_in_time_stays_with_its_agent(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]})
    run.instances.add_work("r0", 40.0)
    assert await reassign(run, "r0", "a", "b", drain_timeout_s=0.1) is None
    assert run.instances.assignment == {"a": ["r1", "r0"], "b": ["r2"]} and run.sent() == []


async def test_the_last_instance_of_an_agent_never_moves(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0"], "b": ["r1"]})
    assert await reassign(run, "r0", "a", "b") is None
    assert run.instances.assignment == {"a": ["r0"], "b": ["r1"]} and run.sent() == []


async def test_same_architecture_swaps_weights_in_place_or_restarts_if_the_instance_refuses(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]}, same_model=True)
    assert same_architecture(run.model_path["a"], run.model_path["b"])
    run.synced("b", 2, b"h")
    done = await reassign(run, "r0", "a", "b")
    assert not done.restarted and run.sent() == [("r0", "LoadWeights", "b", 2)]
    run.server.calls.clear()
    run.server.registry.workers["r3"] = WorkerInfo("r3", b"r3", "rollout", "host", 1, [], {}, 0.0)
    run.instances.engine_started("r3", "a", 0)
    run.instances.serve("r3", "a", "placed by the test")
    run.serving["r3"] = "a"
    run.refuses_swaps.add("r3")  # its engine turns out not to take b's weights
    done = await reassign(run, "r3", "a", "b")
    assert done.restarted
    assert run.sent() == [("r3", "LoadWeights", "b", 2), ("r3", "LoadModel", "b", 0), ("r3", "LoadWeights", "b", 2)]


async def test_an_in_place_swap_a_b_a_before_a_syncs_routes_as_requests_to_an_instance_holding_as_weights(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]}, same_model=True)
    run.synced("a", 2, "handle-a2")
    run.synced("b", 3, "handle-b3")
    assert await reassign(run, "r0", "a", "b") is not None  # b's weights replace a's in place
    assert await reassign(run, "r0", "b", "a") is not None  # ... and back, a still at version 2
    assert run.serving["r0"] == "a", "the instance serves a but holds b's weights"
    assert run.sent()[-1] == ("r0", "LoadWeights", "a", 2)
    assert run.instances.holds("r0", "a") == 2 and run.instances.holds("r0", "b") is None
    run.instances.leave("r1", "a", "so that a's next group can only go to r0")
    task = asyncio.ensure_future(run.client.generate("a", protocol.GenGroup(GroupKey("e", "a", "g"), "a", 2, [1], 2,
                                                                            1.0, 0)))
    await until(lambda: run.server.sent)
    (worker, msg), = run.server.sent
    assert worker == "r0" and run.serving[worker] == "a"
    run.server.answer(msg.request_id)
    assert [worker for _, worker in (await task).parts] == ["r0"]


async def test_the_engine_restarts_while_the_new_agent_syncs_but_joins_only_between_syncs(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]})
    run.synced("b", 1, b"h1")
    await run.sync_lock["b"].acquire()  # b is publishing version 2
    task = asyncio.ensure_future(reassign(run, "r0", "a", "b"))
    await until(lambda: len(run.server.calls) == 1)
    await asyncio.sleep(0.1)
    assert run.sent() == [("r0", "LoadModel", "b", 0)] and "r0" not in run.instances.assignment["b"]
    run.synced("b", 2, b"h2")
    run.sync_lock["b"].release()
    await task
    assert run.sent()[-1] == ("r0", "LoadWeights", "b", 2) and run.instances.assignment["b"] == ["r2", "r0"]


# --- the level 1 loop's log re-drives to the same moves ---------------------------------


async def test_balance_loop_logs_its_inputs_and_replay_check_re_drives_its_moves(tmp_path):
    import collections
    import time

    from flexmarl.controller import replay
    from flexmarl.controller.rollout import balance_loop as rebalance
    from flexmarl.controller.tasks.digit_chain import default_config
    from flexmarl.runtime.config import dump_toml, load_config
    from flexmarl.runtime.eventlog import EventLog, read_events

    cfg = load_config(None, ["router.across_agents=true", "router.interval_s=0.01", "router.patience=2",
                             "router.cooldown_s=0.05", "run.steps=1"], defaults=default_config())
    agents = ["planner", "solver", "checker"]
    log = EventLog(tmp_path / "events.log")
    log.emit(ev.RunStarted(dump_toml(cfg), agents, "async", 0, 0))
    assignment = {a: [f"{a}{i}" for i in range(2)] for a in agents}
    client = types.SimpleNamespace(assignment=assignment, instances=lambda a: list(assignment[a]),
                                   outstanding=collections.defaultdict(float), dispatched_tokens=dict.fromkeys(agents, 0.0))
    workers = {w: types.SimpleNamespace(load={"busy_s": 0.0}) for ws in assignment.values() for w in ws}
    server = types.SimpleNamespace(registry=types.SimpleNamespace(workers=workers))
    done = {"trained": False}
    balancer = rebalance.Rebalancer(cfg.router, whole_models(agents), client, admission=None, client=client, server=server,
                                    weights=None, model_path={}, emit=log.emit, finished=lambda: done["trained"])

    async def fake_reassign(workers, src, dst, why=""):  # the moves themselves are not under test
        for worker in workers:
            assignment[src].remove(worker)
            assignment[dst].append(worker)
            balancer.reassignments.append(rebalance.Reassignment(worker, src, dst, 0.01, 0.02, False))
        return balancer.reassignments[-len(workers):]

    balancer.reassign_together = fake_reassign

    async def skewed_demand():
        """The solver's instances stay busy with a deep queue; the others idle."""
        t0 = time.monotonic()
        while len(balancer.reassignments) < 2 and time.monotonic() - t0 < 20:
            for w in assignment["solver"]:
                client.outstanding[w] = 200000.0  # seconds of work: more than a move costs
                workers[w].load["busy_s"] = time.monotonic() - t0
            client.dispatched_tokens["solver"] += 100.0
            for a in ("planner", "checker"):
                for w in assignment[a]:
                    client.outstanding[w] = 0.0
            await asyncio.sleep(0.003)
        done["trained"] = True  # ends the loop

    await asyncio.gather(balancer.run(), skewed_demand())
    await log.close()
    events, problem = read_events(tmp_path / "events.log")
    assert problem is None
    moves = [e for e in events if isinstance(e, ev.RebalanceDecided)]
    assert len(moves) >= 2 and all(m.dst == "solver" for m in moves)
    assert sum(isinstance(e, ev.DemandObserved) for e in events) > len(moves)
    assert replay.check(events) is None

    altered = [msgspec_replace(e, src="checker" if e.src != "checker" else "planner") if e is moves[0] else e
               for e in events]
    assert "differs" in replay.check(altered)
    assert "re-driving made" in replay.check([e for e in events if e is not moves[-1]])


def msgspec_replace(event, **changes):
    import msgspec

    return msgspec.structs.replace(event, **changes)


async def test_an_instance_whose_drain_timed_out_rejoins_with_its_agents_current_weights(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]})
    run.synced("a", 1, "handle-a1")
    run.instances.add_work("r0", 40.0)  # never drains
    task = asyncio.ensure_future(reassign(run, "r0", "a", "b", drain_timeout_s=0.3))
    await asyncio.sleep(0.05)
    run.synced("a", 2, "handle-a2")  # a synced while r0 was out
    assert await task is None
    assert run.sent() == [("r0", "LoadWeights", "a", 2)]
    assert run.instances.assignment["a"] == ["r1", "r0"] and run.instances.holds("r0", "a") == 2


async def test_after_parking_released_an_agents_weights_a_joining_instance_gets_them_published_again(tmp_path):
    run = FakeRun(tmp_path, {"a": ["r0", "r1"], "b": ["r2"]})
    run.synced("b", 3, "handle-b3")
    run.weights.forget("b")  # the trainer parked b: handle-b3 is gone
    done = await reassign(run, "r0", "a", "b")
    assert done is not None
    assert run.sent() == [("r0", "LoadModel", "b", 0), ("t0", "PublishWeights", "b", protocol.CURRENT_VERSION),
                          ("r0", "LoadWeights", "b", 3)]
    assert run.server.calls[-1][1].handle == "republished-b3"


async def test_parking_an_agent_makes_the_weight_sync_forget_its_released_handle():
    from flexmarl.controller.state.decisions import AgentWork
    from flexmarl.controller.train.allocator import TrainerAllocator

    class Server:
        def next_request_id(self):
            return 1

        async def call(self, worker, msg, buffers=(), timeout=None):
            return protocol.AgentOffloaded(msg.request_id, msg.agent, 2, 0, "parked-state", 10, 0.0), []

    alloc = TrainerAllocator(Server(), ["t0"], 1, {"a": None}, {}, 0, lambda a: AgentWork(), lambda e: None)
    weights = WeightSync(["a"], Server(), lambda a: [], lambda e: None, lambda a, v: None)
    weights.published["a"] = "handle-a2"
    alloc.on_parked.append(weights.forget)
    alloc.resident["a"] = "t0"
    await alloc._park("a")
    assert "a" not in weights.published and "a" in alloc.parked
