"""The training driver wired over a fake cluster, without processes: set-up places every
instance through the one admission, every component reads the one synced version, and
an instance's state survives what used to break it: a resume followed by a rejoin, a
join racing a step over NCCL, a worker dying while a move that timed out puts it back."""

import asyncio
import types

import pytest

from flexmarl.controller.control.registry import WorkerInfo, WorkerRegistry
from flexmarl.controller.control.server import RemoteError, WorkerDied
from flexmarl.controller.run import components
from flexmarl.controller.run.training import TrainingRun
from flexmarl.controller.state import decisions
from flexmarl.controller.tasks.digit_chain import default_config
from flexmarl.controller.train.checkpoints import ResumePoint
from flexmarl.runtime import protocol
from flexmarl.runtime.config import load_config


class FakeCluster:
    """The controller server as the driver uses it, with workers that answer at once: a
    trainer that knows the version each agent is at (and refuses to publish another, as
    the real one does) and rollout workers that load whatever they are sent."""

    def __init__(self, rollout: int, gpus: bool = False) -> None:
        self.registry = WorkerRegistry()
        for i, (worker, role) in enumerate([(f"r{i}", "rollout") for i in range(rollout)] + [("t0", "trainer")]):
            # On GPUs, each worker on a host of its own: weights travel over NCCL.
            host, devices = (f"h{i}", ["cuda:0"]) if gpus else ("h", [])
            self.registry.workers[worker] = WorkerInfo(worker, worker.encode(), role, host, i + 1, devices, {}, 0.0)
        self.on_died, self.on_joined, self.closing = [], [], False
        self.calls: list[tuple[str, str, str, int]] = []
        self.trainer_at: dict[str, int] = {}  # agent -> the version the trainer holds
        self.dies: set[str] = set()
        self._id = 0

    def next_request_id(self) -> int:
        self._id += 1
        return self._id

    def request(self, worker, msg):  # sent at once, as the server's: the call's task started now
        return asyncio.ensure_future(self.call(worker, msg))

    async def call(self, worker, msg, buffers=(), timeout=None, on_sent=None):
        agent = getattr(msg, "agent", "")
        self.calls.append((worker, type(msg).__name__, agent, getattr(msg, "version", None)))
        if worker in self.dies:
            raise WorkerDied(worker, "killed by the test")
        if isinstance(msg, protocol.InitAgent):
            self.trainer_at[agent] = 0
            return protocol.AgentReady(msg.request_id, agent, 0, 10), []
        if isinstance(msg, protocol.LoadAgent):
            self.trainer_at[agent] = msg.version
            return protocol.AgentReady(msg.request_id, agent, msg.version, 10), []
        if isinstance(msg, protocol.PublishWeights):
            at = self.trainer_at[agent]
            if msg.version >= 0 and msg.version != at:  # a negative version asks for the current one
                raise RemoteError(f"asked to publish {agent} version {msg.version}, holding {at}")
            return protocol.WeightsPublished(msg.request_id, agent, at, f"handle-{agent}{at}", 8, 0.0), []
        if isinstance(msg, protocol.LoadModel):
            return protocol.ModelLoaded(msg.request_id, agent, msg.version, 0.0), []
        if isinstance(msg, protocol.LoadWeights):
            return protocol.WeightsLoaded(msg.request_id, agent, msg.version, 0.0), []
        raise AssertionError(f"unexpected {msg!r}")

    def kill(self, worker: str) -> None:
        info = self.registry.workers[worker]
        info.alive = False
        for callback in self.on_died:
            callback(info)

    def restart(self, worker: str) -> None:
        """A new process registers under the dead one's id."""
        info = self.registry.workers[worker]
        info.alive = True
        for callback in self.on_joined:
            callback(info)

    def sent_to(self, worker: str) -> list[tuple[str, str, str, int]]:
        return [c for c in self.calls if c[0] == worker]


class ResumedAt(ResumePoint):
    def training_state(self, agent):  # a saved state the fake trainer loads without looking
        return types.SimpleNamespace(total_bytes=8, path=str(self.agent_dir(agent)))


@pytest.fixture
def make_run(tmp_path, monkeypatch):
    monkeypatch.setattr(components, "resolve_model", lambda name, *_: f"/models/{name.replace(':', '-')}")
    monkeypatch.setattr(components, "has_tokenizer", lambda path: False)
    runs = []

    async def make(server, *overrides, resume_at=None):
        cfg = load_config(None, ["run.steps=8", "run.progress=false", *overrides], defaults=default_config())
        resume = ResumedAt(tmp_path / "checkpoints" / f"step-{resume_at:06d}", resume_at, {}) if resume_at else None
        run = TrainingRun(cfg, server, tmp_path, emit=lambda e: None, flush_events=None,
                          worker_ids=lambda role: [w.worker_id for w in server.registry.alive(role)], resume=resume)
        runs.append(run)
        await run.setup()
        return run

    yield make
    for run in runs:
        run.parts.metrics.close()
        run.parts.tools.shutdown()


def placed(run) -> dict[str, list[str]]:
    """agent -> its instances, read the way the driver's checkpoint reads them."""
    return run.parts.checkpoints.controller_state(0)["rollout_assignment"]


async def test_set_up_admits_every_instance_and_one_synced_version_moves_gate_and_instances(make_run):
    server = FakeCluster(rollout=4)
    run = await make_run(server, "router.across_agents=true")
    assert sorted(w for ws in placed(run).values() for w in ws) == ["r0", "r1", "r2", "r3"]
    for agent, workers in placed(run).items():
        assert run.parts.client.instances(agent) == workers and run.parts.rejoin.instances is run.parts.instances
        assert [run.parts.instances.holds(w, agent) for w in workers] == [0] * len(workers)
    agent = list(run.cfg.agents)[0]
    gate = asyncio.ensure_future(run.parts.schedule.gate(agent, 3))  # batch 3 at K = 0 needs version 2
    await asyncio.sleep(0)
    assert not gate.done()
    server.trainer_at[agent] = 2
    await run.parts.weights.sync(agent, "t0", 2)
    await asyncio.wait_for(gate, 1)
    assert run.parts.versions[agent] == 2 and run.parts.schedule.versions is run.parts.versions
    assert [run.parts.instances.holds(w, agent) for w in placed(run)[agent]] == [2] * len(placed(run)[agent])


async def test_after_a_resume_a_worker_that_rejoins_before_the_first_sync_serves_the_resumed_version(make_run):
    server = FakeCluster(rollout=3)
    run = await make_run(server, resume_at=4)
    agent, worker = next((a, ws[0]) for a, ws in placed(run).items() if len(ws) == 1)
    assert server.sent_to(worker) == [(worker, "LoadModel", agent, 4)]  # set-up: the checkpoint's weights
    server.kill(worker)
    server.restart(worker)
    assert await run.parts.rejoin.serve(worker) == agent
    loads = [c for c in server.sent_to(worker) if c[1] in ("LoadModel", "LoadWeights")]
    assert loads[-2:] == [(worker, "LoadModel", agent, 0), (worker, "LoadWeights", agent, 4)]
    # K = 0 in batch 5 (trains version 4): what it generates at version 4 is never dropped as stale
    assert run.cfg.pipeline.max_staleness == 0
    assert decisions.may_generate(5, 4, 0) and not decisions.too_stale(4, [loads[-1][3]], 0)
    await asyncio.wait_for(run.parts.schedule.gate(agent, 5), 1)


async def test_a_join_racing_a_step_over_nccl_serves_the_version_current_when_it_loads(make_run):
    server = FakeCluster(rollout=3, gpus=True)
    run = await make_run(server)
    agent, worker = next((a, ws[0]) for a, ws in placed(run).items() if len(ws) == 1)
    server.trainer_at[agent] = 1  # the agent steps to 1 and syncs
    await run.parts.weights.sync(agent, "t0", 1)
    server.kill(worker)
    server.restart(worker)
    since = len(server.calls)
    server.trainer_at[agent] = 2  # it steps to 2; that sync must wait for the join's hold on the agent
    join = asyncio.ensure_future(run.parts.rejoin.serve(worker))
    await asyncio.sleep(0)  # the join starts the engine, then takes the agent's sync lock
    sync = asyncio.ensure_future(run.parts.weights.sync(agent, "t0", 2))
    assert await join == agent, "the instance was left serving no agent"
    await sync
    publishes = [c for c in server.calls if c[1] == "PublishWeights"]
    assert all(version in (1, 2, protocol.CURRENT_VERSION) for _, _, _, version in publishes)
    loads = [c[3] for c in server.calls[since:] if c[:2] == (worker, "LoadWeights")]
    assert loads and loads[0] == 2  # the join loaded what the trainer held, not the refused version 1
    assert worker in placed(run)[agent]


async def test_a_worker_dying_while_a_timed_out_move_puts_it_back_fails_only_that_move(make_run):
    server = FakeCluster(rollout=4)
    run = await make_run(server, "router.across_agents=true")
    src, (worker, stays) = next((a, ws) for a, ws in placed(run).items() if len(ws) == 2)
    dst = next(a for a in run.cfg.agents if a != src)
    server.trainer_at[src] = 1
    await run.parts.weights.sync(src, "t0", 1)
    run.parts.client.outstanding[worker] += 40.0  # a request in flight on it that never finishes

    async def src_syncs_and_the_worker_dies():
        await asyncio.sleep(0.02)
        server.trainer_at[src] = 2
        await run.parts.weights.sync(src, "t0", 2)  # while it was out: putting it back needs a load
        server.dies.add(worker)

    moved, _ = await asyncio.gather(run.parts.rebalancer.reassign(worker, src, dst, drain_timeout_s=0.1),
                                    src_syncs_and_the_worker_dies())
    assert moved is None
    assert placed(run)[src] == [stays] and worker not in placed(run)[dst]
    # the run goes on: the agent still syncs and its other instance loads the new version
    server.trainer_at[src] = 3
    await run.parts.weights.sync(src, "t0", 3)
    assert server.sent_to(stays)[-1] == (stays, "LoadWeights", src, 3)


def register_again(server: FakeCluster, worker: str) -> None:
    """Its process died (declared dead) and the next one registered under its id."""
    old = server.registry.workers[worker]
    server.kill(worker)
    new = WorkerInfo(worker, worker.encode() + b"-again", old.role, old.host, old.pid + 100, [], {}, 0.0)
    server.registry.workers[worker] = new
    for callback in server.on_joined:
        callback(new)


class DiesStartingItsEngine(FakeCluster):
    """`victim` dies while its engine starts at set-up; with `back`, its next process
    registers before the call fails (the launcher restarted it at once)."""

    def __init__(self, rollout: int, victim: str, back: bool) -> None:
        super().__init__(rollout)
        self.victim, self.back, self.died = victim, back, False

    async def call(self, worker, msg, buffers=(), timeout=None, on_sent=None):
        if worker == self.victim and isinstance(msg, protocol.LoadModel) and not self.died:
            self.died = True
            await asyncio.sleep(0.01)
            if self.back:
                register_again(self, worker)
            else:
                self.kill(worker)
            raise WorkerDied(worker, "killed by the test while its engine started")
        return await super().call(worker, msg, buffers, timeout, on_sent)


@pytest.mark.parametrize("back", [True, False], ids=["back-during-set-up", "back-after-set-up"])
async def test_a_rollout_worker_dying_while_its_engine_starts_at_set_up_is_replaced_and_the_run_goes_on(
        make_run, back):
    server = DiesStartingItsEngine(rollout=3, victim="r1", back=back)
    run = await make_run(server)  # set-up does not stop the run
    assert run.parts.ready.is_set()
    assert all("r1" not in ws for ws in placed(run).values())
    if not back:
        register_again(server, "r1")  # after set-up: an ordinary rejoin
    assert run.parts.rejoin.queue.get_nowait() == "r1" and run.parts.rejoin.queue.empty()
    unit = await run.parts.rejoin.serve("r1")
    assert unit is not None and "r1" in placed(run)[unit]
    assert server.sent_to("r1")[-1][1] == "LoadModel"  # the new process started its engine


async def test_a_rollout_worker_refusing_its_engine_at_set_up_stops_the_run_in_one_line_naming_it(make_run):
    from flexmarl.controller.state.failures import RunFailed

    class Refuses(FakeCluster):
        async def call(self, worker, msg, buffers=(), timeout=None, on_sent=None):
            if worker == "r1" and isinstance(msg, protocol.LoadModel):
                raise RemoteError("r1: LoadModel failed: out of memory")
            return await super().call(worker, msg, buffers, timeout, on_sent)

    with pytest.raises(RunFailed, match=r"rollout worker r1 \(\w+\) could not start its engine") as failure:
        await make_run(Refuses(rollout=3))
    assert "\n" not in str(failure.value)


async def test_a_trainer_registered_again_during_set_up_joins_the_pool_at_once(make_run):
    registered = False

    class TrainerBack(FakeCluster):
        async def call(self, worker, msg, buffers=(), timeout=None, on_sent=None):
            nonlocal registered
            if isinstance(msg, protocol.InitAgent) and not registered:  # the pool's trainer died, came back
                registered = True
                register_again(self, "t0")
            return await super().call(worker, msg, buffers, timeout, on_sent)

    server = TrainerBack(rollout=3)
    run = await make_run(server)
    assert registered and run.parts.allocator.trainers == ["t0"]
