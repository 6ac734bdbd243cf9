"""A fake cluster for measuring one real controller: rollout and trainer workers that speak
the real protocol over real ZeroMQ sockets, with modelled costs instead of models.

Each fake worker is a real `WorkerSession` (HELLO, WELCOME, heartbeats both ways, SHUTDOWN)
with its own DEALER socket; many of them share one helper process and its event loop, since
a small machine cannot hold a process per instance, and that loop's one stall watch (a
watch per session is a thread and a ticker each: 256 sessions waiting idle used 0.09 of a
core with one each, 0.03-0.04 with one for all). What they execute is a cost model:

- `FakeEngine` (rollout): answers a GENERATE message after `batch_s + tokens / tokens_per_s`
  seconds, where tokens are the message's output tokens (max_tokens of each member of each
  group; outputs always run to max_tokens), one message at a time in arrival order, every
  group whole in one reply. Every result carries the version the instance holds when the
  message starts. LOAD_MODEL and LOAD_WEIGHTS take
  `load_s` and are applied in the same order, so a weight swap waits for earlier batches.
- `FakeTrainer`: a micro-batch takes `mb_s + tokens / train_tokens_per_s`, a step `step_s`,
  a publication `publish_s`; commands run one at a time in arrival order. It refuses, as
  the real trainer does, a step whose sample count differs from what it accumulated, and
  also a sample it was sent before (so a double use fails the run instead of passing).

Weights are handles only: PUBLISH_WEIGHTS returns a `ParamHandle` with no layout and no
bytes behind it (transport as the controller asked), and LOAD_WEIGHTS checks that the
handle is the version's it names, then acknowledges; another agent's weights (an instance
moved between agents of one model) only with no GENERATE of its own agent left, as the real
worker swaps them in place. Nothing is copied.

A helper process (`python -m flexmarl.controller.testing.fake_cluster SPEC_JSON`) runs the workers SPEC lists
until every one was told to shut down, then writes what each did to SPEC["out"] (JSON):
samples and tokens trained per agent, batches, busy seconds, refusals.

The workflows the benchmark drives are here too (`chain_episode`, `wide_episode`), loaded
by the controller as `run.workflow = "flexmarl.controller.testing.fake_cluster:chain_episode"`.

It knows nothing about the controller's internals: only the wire protocol.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import sys
from typing import Any

from flexmarl.runtime import protocol
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.params.types import Location, ParamHandle
from flexmarl.workers.session import CommandHandler

log = logging.getLogger("flexmarl.fake_cluster")

DEFAULT_COSTS = {
    "tokens_per_s": 4000.0,  # one rollout instance's output tokens per second
    "batch_s": 0.002,  # per GENERATE batch
    "load_s": 0.005,  # LOAD_MODEL / LOAD_WEIGHTS
    "train_tokens_per_s": 400000.0,  # one trainer's trained tokens per second
    "mb_s": 0.002,  # per micro-batch
    "step_s": 0.005,
    "publish_s": 0.005,
    "weights_bytes": 1 << 30,  # what a handle says it holds (nothing is moved)
}


class _Serial:
    """One command at a time, in arrival order, each after its modelled seconds."""

    def __init__(self) -> None:
        self.queue: collections.deque = collections.deque()
        self.wake = asyncio.Event()
        self.busy_s = 0.0

    def push(self, seconds: float, act: Any) -> None:
        self.queue.append((seconds, act))
        self.wake.set()

    async def run(self) -> None:
        while True:
            if not self.queue:
                self.wake.clear()
                await self.wake.wait()
                continue
            seconds, act = self.queue.popleft()
            if seconds > 0:
                await asyncio.sleep(seconds)
            self.busy_s += seconds
            await act()


class FakeWorker(CommandHandler):
    """A `CommandHandler` (workers/session.py) whose commands cost modelled time."""

    role = "worker"

    def __init__(self, worker_id: str, costs: dict[str, float]) -> None:
        super().__init__()
        self.worker_id = worker_id
        self.costs = costs
        self.session: Any = None
        self.serial = _Serial()
        self.errors: list[str] = []

    async def reply(self, msg: protocol.Message, buffers: Any = ()) -> None:
        await self.session.send(msg, buffers)

    async def refuse(self, request_id: int, why: str) -> None:
        self.errors.append(why)
        await self.reply(protocol.Error(request_id, why))

    async def run(self) -> None:
        await self.serial.run()

    def load(self) -> dict[str, float]:
        return {"busy_s": self.serial.busy_s}

    def close(self) -> None:
        pass

    def report(self) -> dict[str, Any]:
        """What the worker did, for the bench's table."""
        return {"worker": self.worker_id, "errors": self.errors}

    async def handle(self, msg: protocol.Message, buffers: list[Any]) -> None:
        if isinstance(msg, protocol.Echo):
            await self.reply(protocol.EchoReply(msg.request_id, msg.payload, self.load()))
            return
        await self.refuse(getattr(msg, "request_id", 0), f"fake {self.role} cannot handle {type(msg).__name__}")


class FakeEngine(FakeWorker):
    role = "rollout"

    def __init__(self, worker_id: str, costs: dict[str, float]) -> None:
        super().__init__(worker_id, costs)
        self.agent = ""
        self.version = -1
        self.samples = 0
        self.batches = 0
        self.queued = 0  # GENERATE messages received and not yet answered

    async def handle(self, msg: protocol.Message, buffers: list[Any]) -> None:
        c = self.costs
        match msg:
            case protocol.LoadModel():
                self.serial.push(c["load_s"], lambda: self._loaded(msg))
            case protocol.LoadWeights():
                self.serial.push(c["load_s"], lambda: self._weights(msg))
            case protocol.Generate():
                self.queued += 1
                tokens = sum(g.n * g.max_tokens for g in msg.groups)
                self.serial.push(c["batch_s"] + tokens / c["tokens_per_s"], lambda: self._generated(msg))
            case protocol.AbortGroups():
                pass  # every group of a message comes back whole: as one that finished before the abort
            case _:
                await super().handle(msg, buffers)

    async def _loaded(self, msg: protocol.LoadModel) -> None:
        self.agent, self.version = msg.agent, msg.version
        await self.reply(protocol.ModelLoaded(msg.request_id, msg.agent, msg.version, self.costs["load_s"]))

    async def _weights(self, msg: protocol.LoadWeights) -> None:
        h = msg.handle  # a snapshot's is its source's: the version alone must match
        if h is None or h.version != msg.version or (msg.agent != self.agent and self.queued):
            await self.refuse(msg.request_id, f"{self.worker_id} serves {self.agent}"
                                              f"{f' ({self.queued} GENERATEs queued)' if self.queued else ''}; "
                                              f"handle {h} for {msg.agent} v{msg.version}")
            return
        # As the real worker: another agent's weights swap in place once nothing of its
        # own agent is left to generate (an instance moved between agents of one model).
        self.agent, self.version = msg.agent, msg.version
        await self.reply(protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version, self.costs["load_s"]))

    async def _generated(self, msg: protocol.Generate) -> None:
        self.queued -= 1
        stranger = next((g.agent for g in msg.groups if g.agent != self.agent), None)
        if stranger is not None:
            await self.refuse(msg.request_id, f"{self.worker_id} serves {self.agent}, not {stranger}")
            return
        results = [_scored(g, self.version) if g.score_from >= 0 else protocol.GroupResult(
            g.key, g.first, self.version, [g.max_tokens] * g.n,
            protocol.packed(protocol.TOKEN_TYPECODE, [t for j in range(g.n) for t in fake_tokens(g.seed + j, g.max_tokens)]),
            protocol.packed(protocol.LOGPROB_TYPECODE, [-1.0] * (g.n * g.max_tokens)), ["length"] * g.n, turn=g.turn)
            for g in msg.groups]
        self.samples += sum(g.n for g in msg.groups)
        self.batches += 1
        await self.reply(protocol.Generated(msg.request_id, results, True, self.load()))

    def report(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "role": self.role, "samples": self.samples, "batches": self.batches,
                "busy_s": self.serial.busy_s, "errors": self.errors}


class FakeTrainer(FakeWorker):
    role = "trainer"

    def __init__(self, worker_id: str, costs: dict[str, float]) -> None:
        super().__init__(worker_id, costs)
        self.version: dict[str, int] = {}
        self.accumulated: collections.Counter[str] = collections.Counter()
        self.trained: dict[str, set] = collections.defaultdict(set)  # agent -> samples ever trained (group key, member)
        self.tokens: collections.Counter[str] = collections.Counter()
        self.steps: collections.Counter[str] = collections.Counter()
        self.micro_batches = 0

    async def handle(self, msg: protocol.Message, buffers: list[Any]) -> None:
        c = self.costs
        match msg:
            case protocol.InitAgent():
                self.serial.push(c["load_s"], lambda: self._init(msg))
            case protocol.TrainMicroBatch():
                tokens = sum(sum(g.lengths) for g in msg.groups)
                self.serial.push(c["mb_s"] + tokens / c["train_tokens_per_s"], lambda: self._micro_batch(msg, tokens))
            case protocol.OptimStep():
                self.serial.push(c["step_s"], lambda: self._step(msg))
            case protocol.PublishWeights():
                self.serial.push(c["publish_s"], lambda: self._publish(msg))
            case protocol.SaveCheckpoint():
                self.serial.push(c["load_s"], lambda: self.reply(protocol.CheckpointSaved(
                    msg.request_id, msg.agent, msg.path, self.version.get(msg.agent, 0))))
            case _:
                await super().handle(msg, buffers)

    async def _init(self, msg: protocol.InitAgent) -> None:
        self.version[msg.agent] = 0
        await self.reply(protocol.AgentReady(msg.request_id, msg.agent, 0, 1))

    async def _micro_batch(self, msg: protocol.TrainMicroBatch, tokens: int) -> None:
        if self.version.get(msg.agent, -1) != msg.version - 1:
            await self.refuse(msg.request_id, f"{msg.agent} is at {self.version.get(msg.agent)}, micro-batch for "
                                              f"version {msg.version}")
            return
        seen = self.trained[msg.agent]
        samples = [(g.key, j) for g in msg.groups for j in range(len(g.lengths))]
        again = [key.sample(j) for key, j in samples if (key, j) in seen]
        if again:
            await self.refuse(msg.request_id, f"samples trained before: {again[:3]}")
            return
        seen.update(samples)
        self.accumulated[msg.agent] += len(samples)
        self.tokens[msg.agent] += tokens
        self.micro_batches += 1
        await self.reply(protocol.MicroBatchDone(msg.request_id, msg.agent, 0.0, tokens, self.costs["mb_s"]))

    async def _step(self, msg: protocol.OptimStep) -> None:
        have = self.accumulated[msg.agent]
        if msg.samples != have:
            await self.refuse(msg.request_id, f"step of {msg.agent} for {msg.samples} samples; {have} accumulated")
            return
        self.accumulated[msg.agent] = 0
        self.version[msg.agent] = msg.version
        self.steps[msg.agent] += 1
        await self.reply(protocol.StepDone(msg.request_id, msg.agent, msg.version, 0.0, self.costs["step_s"],
                                           protocol.StepStats(samples=have)))

    async def _publish(self, msg: protocol.PublishWeights) -> None:
        # CURRENT_VERSION (a joining instance's publication): whichever version the agent is at.
        version = self.version[msg.agent] if msg.version == protocol.CURRENT_VERSION else msg.version
        nbytes = int(self.costs["weights_bytes"])
        handle = ParamHandle(transport=msg.transport, agent=msg.agent, version=version,
                             key=f"{self.worker_id}/{msg.agent}/{version}", layout=[], total_bytes=nbytes,
                             checksum=None, publisher=Location(socket.gethostname(), os.getpid()))
        await self.reply(protocol.WeightsPublished(msg.request_id, msg.agent, version, handle, nbytes,
                                                   self.costs["publish_s"]))

    def report(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "role": self.role, "micro_batches": self.micro_batches,
                "samples": {a: len(s) for a, s in self.trained.items()}, "tokens": dict(self.tokens),
                "steps": dict(self.steps), "busy_s": self.serial.busy_s, "errors": self.errors}


def fake_tokens(seed: int, n: int) -> list[int]:
    """n token ids (digits 4..13) drawn from the request's seed: the same request, the same tokens."""
    return [4 + (seed >> (3 * j)) % 10 for j in range(n)]


# ---------------------------------------------------------------- the helper process

ROLES = {"rollout": FakeEngine, "trainer": FakeTrainer}


async def serve(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs every worker of `spec` until each session ends; returns their reports."""
    import zmq
    import zmq.asyncio

    from flexmarl.runtime import collector
    from flexmarl.runtime.aio import StallWatch
    from flexmarl.workers.session import WorkerSession

    zmq.asyncio.Context.instance().set(zmq.MAX_SOCKETS, 4 * len(spec["workers"]) + 64)
    costs = {**DEFAULT_COSTS, **spec.get("costs", {})}
    cfg = TransportConfig(**spec.get("transport", {}))
    handlers = [ROLES[role](worker_id, costs) for role, worker_id in spec["workers"]]
    # One loop, one stall watch for all its sessions (a watch per session is a thread and a
    # ticker each: hundreds of them would take the helper's core from the replies).
    sessions = [WorkerSession(cfg, spec["address"], h, h.worker_id, new_handler=_no_second_life, watch_loop=False)
                for h in handlers]
    # The controller's collector policy (runtime/collector.py): at the default thresholds a
    # thousand sessions' heap was walked over and over, a sixth of the helper's time.
    async with StallWatch(f"fake cluster {os.getpid()}").watching(), collector.swept():
        codes = await asyncio.gather(*(s.run() for s in sessions), return_exceptions=True)
    reports = [h.report() for h in handlers]
    for report, code in zip(reports, codes):
        report["exit"] = code if isinstance(code, int) else repr(code)
    return reports


def _no_second_life() -> FakeWorker:
    raise RuntimeError("a fake worker does not register again")


def main() -> None:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname).1s fake %(message)s")
    try:
        import uvloop
        reports = uvloop.run(serve(spec))
    except ImportError:
        reports = asyncio.run(serve(spec))
    with open(spec["out"], "w") as f:
        json.dump(reports, f)


# ---------------------------------------------------------------- workflows

# The digit chain's shape (controller/tasks/digit_chain.py): a plan stage, a solve stage and a
# check stage; 4 plans per query, 4 answers per plan, 2 checks per answer; 3, 6 and 1
# output tokens. With more than three agents, agent i plays stage i % 3 and each episode
# draws one agent per stage.
CHAIN_STAGES = 3
CHAIN_GROUP = (4, 4, 2)
CHAIN_TOKENS = (3, 6, 1)


def chain_agents(n: int) -> dict[str, dict[str, Any]]:
    return {f"agent{i:02d}": {"group_size": CHAIN_GROUP[i % CHAIN_STAGES], "max_tokens": CHAIN_TOKENS[i % CHAIN_STAGES]}
            for i in range(n)}


def wide_agents(n: int, group: int = 4, tokens: int = 4) -> dict[str, dict[str, Any]]:
    return {f"agent{i:02d}": {"group_size": group, "max_tokens": tokens} for i in range(n)}


def _score(ids: list[int]) -> float:
    return sum(t % 2 for t in ids) / max(1, len(ids))


async def chain_episode(ctx: Any) -> None:
    names = list(ctx.agents)
    stage = [ctx.rng.choice(names[s::CHAIN_STAGES]) for s in range(CHAIN_STAGES)]
    query = [4 + ctx.rng.randrange(10) for _ in range(3)]
    plans = await ctx.generate(stage[0], [1, 14, *query, 15])
    for p in plans:
        ctx.reward(p, _score(p.output_ids))

    async def solve(plan: list[int]) -> None:
        answers = await ctx.generate(stage[1], [1, 15, *plan, 16])
        for a in answers:
            ctx.reward(a, _score(a.output_ids))
        await asyncio.gather(*(check(plan, a.output_ids) for a in answers))

    async def check(plan: list[int], answer: list[int]) -> None:
        verdicts = await ctx.generate(stage[2], [1, 15, *plan, 16, *answer, 17])
        for v in verdicts:
            ctx.reward(v, _score(v.output_ids))

    await asyncio.gather(*(solve(p.output_ids) for p in plans))


async def wide_episode(ctx: Any) -> None:
    """Every agent once, all at once, each on its own prompt."""
    query = [4 + ctx.rng.randrange(10) for _ in range(3)]

    async def one(i: int, agent: str) -> None:
        for s in await ctx.generate(agent, [1, 4 + i % 10, *query]):
            ctx.reward(s, _score(s.output_ids))

    await asyncio.gather(*(one(i, a) for i, a in enumerate(ctx.agents)))


WORKFLOWS = {"chain": ("chain_episode", chain_agents), "wide": ("wide_episode", wide_agents)}


def _scored(g: protocol.GenGroup, version: int) -> protocol.GroupResult:
    """A scoring request's reply (a teacher's view of a member): -1.0 for each id scored;
    with score_top_k k, ids 0 to k - 1 at each position, each of logprob -1.0."""
    scored, k = g.prompt_ids[g.score_from:], g.score_top_k
    return protocol.GroupResult(g.key, g.first, version, [len(scored)], protocol.packed(protocol.TOKEN_TYPECODE, scored),
                                protocol.packed(protocol.LOGPROB_TYPECODE, [-1.0] * len(scored)), ["score"], turn=g.turn,
                                top_ids=protocol.packed(protocol.TOKEN_TYPECODE, list(range(k)) * len(scored)),
                                top_logprobs=protocol.packed(protocol.LOGPROB_TYPECODE, [-1.0] * (k * len(scored))))


if __name__ == "__main__":
    main()
