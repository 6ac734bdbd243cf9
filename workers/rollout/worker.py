"""Rollout worker: hosts one inference engine (vLLM) serving one model at a time: one
agent's whole weights, or a shared base with the adapters of every agent it was sent.

The receive loop only queues; one engine loop (`run`) owns the engine and, between two
engine steps, applies control operations in order (load a model, swap weights in place;
a swap waits for the requests in flight to finish and holds back new ones, so no sample
mixes two policy versions, unless it says `in_flight` "keep" or "recompute": then it is
applied between two steps, the requests continue under the new weights and each token's
version comes back with its group), admits newly arrived groups (continuous batching: a message
that arrives mid-generation joins at the next step), each as one engine request of n
samples, and reports finished groups, whole, in one GENERATED message per GENERATE
request per step (group_requests.py keeps that bookkeeping). Every group carries the
weights version it was admitted under, so the controller can check staleness exactly.

A message naming an agent this instance does not serve is answered with an error (the
controller sends it elsewhere). A group the engine refuses to run (empty prompt, too long
for the model, a token id outside the vocabulary) fails alone: it comes back at once in the
GENERATED message's `refused` list with the reason, and the rest of its message, and the
worker, carry on. ABORT_GROUPS names groups nobody waits for any more (their episode was
abandoned): between two engine steps one still queued leaves its message and one running
is aborted in the engine, and each comes back once, in `refused` marked `aborted`; a name
matching nothing (its group already came back) is forgotten. Any other engine failure ends the worker: the engine is then in no known
state.

An engine started with LoRA slots serves every agent whose adapter it was sent (LOAD_WEIGHTS
with `lora`, or LOAD_ADAPTER with a checkpoint's adapter directory): such a load waits for
nothing. Under `in_flight` "finish" requests in flight keep the adapter version they were
admitted under (the engine unloads it after them) and each sample carries that version;
under "keep" or "recompute" they move to the new version between two steps, each token
labelled with the version that made it, as with whole weights.

Whole weights (LOAD_WEIGHTS without `lora`) are received by the engine's own workers, one
per tensor-parallel rank, each through a parameter channel of its own (engine_receive.py):
this process passes the handle and the rank, and holds none of the bytes; an adapter is
received here. CANCEL_LOAD names a publication by its key, for both: a queued load of it is
dropped, a receive of it under way is given up (through the engine's workers, or this
process's channel), and nothing else is touched, a later publication of the same version
least of all.

Engine calls run on a worker thread, so heartbeats keep flowing during a long load.
It decides nothing: which agent, which requests and which weights come from the controller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from flexmarl.runtime import protocol
from flexmarl.runtime.checksums import verify_files
from flexmarl.runtime.keys import GroupKey

from ..session import CommandHandler
from .engine import RequestRefused
from .group_requests import RunningGroups, cost

log = logging.getLogger("flexmarl.rollout")


class RolloutHandler(CommandHandler):
    role = "rollout"

    def __init__(self, channel_config: Any = None) -> None:
        super().__init__()
        self.channel_config = channel_config  # ParamChannelConfig; None: the channel's defaults
        self.engine: Any = None
        self.agent = ""
        self.version = -1
        self._control: list[protocol.LoadModel | protocol.LoadWeights] = []
        self._adapter_loads: list[protocol.LoadWeights | protocol.LoadAdapter] = []  # between steps, in flight or not
        self._admit: list[protocol.Generate] = []
        self._aborts: set[tuple[GroupKey, int, int]] = set()  # groups to abort between two steps
        self._running = RunningGroups()
        self._wake = asyncio.Event()
        self.busy_s = 0.0
        # Engine steps' seconds, and their seconds times the samples running in them: how
        # full the engine's batch was (sequence_s / step_s: samples per step, time-weighted).
        self.step_s = self.sequence_s = 0.0
        # Weight loads of this agent applied, and the seconds they waited between arriving
        # and being applied (for requests in flight, under "finish").
        self.loads = 0
        self.load_wait_s = 0.0
        self.load_wait_max_s = 0.0  # the longest single wait: a mean of a few loads hides one stall
        self._arrived: dict[int, float] = {}  # a queued control message's request id -> when it came
        self._rate = 0.0  # tokens/s, exponentially smoothed over steps
        self._channel: Any = None
        self._applying: protocol.LoadModel | protocol.LoadWeights | protocol.LoadAdapter | None = None  # running now

    async def handle(self, msg: protocol.Message, buffers: list[Any]) -> None:
        match msg:
            case protocol.LoadWeights() if msg.lora is not None:
                self._adapter_loads.append(msg)
            case protocol.LoadAdapter():
                self._adapter_loads.append(msg)
            case protocol.Generate():
                stranger = next((g.agent for g in msg.groups if not self._serves(g.agent)), None)
                if stranger is not None:
                    await self.reply(protocol.Error(msg.request_id, f"this instance serves {self.agent or 'nothing'}, "
                                                                    f"not {stranger}; reload it first"))
                    return
                self._admit.append(msg)
            case protocol.LoadModel() | protocol.LoadWeights():
                self._arrived[msg.request_id] = time.perf_counter()
                self._control.append(msg)
            case protocol.AbortGroups():  # between two engine steps: the engine is the engine loop's
                self._aborts.update(zip(msg.keys, msg.firsts, msg.turns))
            case protocol.CancelLoad():  # at once, not behind the engine's work
                await self._cancel_load(msg)
                return
            case _:
                await super().handle(msg, buffers)
                return
        self._wake.set()

    async def _cancel_load(self, msg: protocol.CancelLoad) -> None:
        """The LoadWeights of the publication `msg.key` fails now: dropped if still queued,
        its receive given up if running (it waits on an NCCL group one of whose ranks died)."""
        for queue in (self._control, self._adapter_loads):
            for load in [m for m in queue if isinstance(m, protocol.LoadWeights) and m.handle is not None
                         and m.handle.key == msg.key]:
                queue.remove(load)
                self._arrived.pop(load.request_id, None)
                await self.reply(protocol.Error(load.request_id, f"LoadWeights for {load.agent} version {load.version} "
                                                                 "cancelled: another rank of its broadcast died"))
        applying = self._applying
        if isinstance(applying, protocol.LoadWeights) and applying.handle is not None and applying.handle.key == msg.key:
            if applying.lora is not None:
                self.channel().cancel(msg.key)  # an adapter is received here
            elif self.engine is not None:
                self.engine.cancel_receive(msg.key)  # whole weights: in the engine's workers
        await self.reply(protocol.LoadCancelled(msg.request_id, msg.agent))

    def load(self) -> dict[str, float]:
        queued = sum(g.n for m in self._admit for g in m.groups)
        tokens = self._running.tokens + sum(cost(g) for m in self._admit for g in m.groups)
        return {"queued_requests": float(queued + self._running.samples), "queued_tokens": float(tokens),
                "tokens_per_s": self._rate, "busy_s": self.busy_s, "version": float(self.version),
                "step_s": self.step_s, "sequence_s": self.sequence_s, "loads": float(self.loads),
                "load_wait_s": self.load_wait_s, "load_wait_max_s": self.load_wait_max_s}

    async def run(self) -> None:
        while True:
            if not (self._control or self._admit or self._running or self._adapter_loads or self._aborts):
                self._wake.clear()
                await self._wake.wait()
            if self._aborts:
                await self._abort()
            while self._adapter_loads:
                await self._apply(self._adapter_loads.pop(0))
            busy = self.engine is not None and self.engine.has_unfinished()
            while self._control and (not busy or self._continues(self._control[0])):
                await self._apply(self._control.pop(0))
            if not self._control:
                # A pending weight swap holds back new admissions until the requests in
                # flight finish: every sample is generated by exactly one policy version.
                # All are admitted before any reply is awaited, so a swap that arrives
                # meanwhile waits for the next round.
                admitted, self._admit = self._admit, []
                refusals = [self._start(msg) for msg in admitted]
                for reply in refusals:
                    if reply is not None:
                        await self.reply(reply)
            if self.engine is not None and self.engine.has_unfinished():
                await self._step()

    async def _abort(self) -> None:
        """Drops the groups an AbortGroups named: those still queued leave their message,
        those running are aborted in the engine; each comes back refused as aborted, once.
        A name matching nothing (its group finished and came back) is forgotten."""
        names, self._aborts = self._aborts, set()
        replies: dict[int, list[protocol.GroupRefused]] = {}
        for msg in self._admit:
            kept = [g for g in msg.groups if (g.key, g.first, g.turn) not in names]
            if len(kept) < len(msg.groups):
                replies[msg.request_id] = [protocol.GroupRefused(g.key, g.first, "aborted", g.turn, aborted=True)
                                           for g in msg.groups if (g.key, g.first, g.turn) in names]
                msg.groups = kept
        running = self._running.aborted(names)
        if running:
            self.engine.abort(list(running))
        for engine_id, (request_id, group) in running.items():
            replies.setdefault(request_id, []).append(
                protocol.GroupRefused(group.key, group.first, "aborted", group.turn, aborted=True))
        self._admit = [m for m in self._admit if m.groups or m.request_id not in replies]
        queued = {m.request_id for m in self._admit}
        for request_id, refused in replies.items():
            done = request_id not in queued and self._running.done(request_id)
            await self.reply(protocol.Generated(request_id, [], done, self.load(), refused))

    def _continues(self, msg: protocol.LoadModel | protocol.LoadWeights) -> bool:
        """A load that lets the requests in flight continue: new weights of the agent served
        now, with `in_flight` "keep" or "recompute"; any other control waits for them."""
        return (isinstance(msg, protocol.LoadWeights) and msg.agent == self.agent
                and msg.in_flight in ("keep", "recompute"))

    async def _apply(self, msg: protocol.LoadModel | protocol.LoadWeights | protocol.LoadAdapter) -> None:
        t0 = time.perf_counter()
        arrived = self._arrived.pop(msg.request_id, t0)
        if isinstance(msg, protocol.LoadWeights):
            self.loads += 1
            self.load_wait_s += t0 - arrived
            self.load_wait_max_s = max(self.load_wait_max_s, t0 - arrived)
        self._applying = msg
        try:
            match msg:
                case protocol.LoadModel():
                    await asyncio.to_thread(self._load_model, msg)
                    reply: protocol.Message = protocol.ModelLoaded(msg.request_id, msg.agent, msg.version,
                                                                   time.perf_counter() - t0)
                case protocol.LoadWeights():
                    await asyncio.to_thread(self._load_weights, msg)
                    reply = protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version,
                                                   time.perf_counter() - t0)
                case protocol.LoadAdapter():
                    await asyncio.to_thread(self._load_adapter_dir, msg)
                    reply = protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version,
                                                   time.perf_counter() - t0)
        except Exception as exc:
            log.exception("%s failed", type(msg).__name__)
            reply = protocol.Error(msg.request_id, f"{type(msg).__name__} for {msg.agent} failed: {exc!r}")
        finally:
            self._applying = None
        self.busy_s += time.perf_counter() - t0
        await self.reply(reply)

    def _load_model(self, msg: protocol.LoadModel) -> None:
        from .engine import VllmEngine

        if self._running:
            raise RuntimeError(f"cannot switch models with {self._running.samples} samples in flight")
        verify_files(msg.model_path, msg.checksums)  # a checkpoint's files, before the engine reads them
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.engine = VllmEngine(msg.model_path, seed=msg.seed, max_model_len=msg.max_model_len,
                                 settings=msg.engine)
        self.agent, self.version = msg.agent, msg.version
        self.engine.label_weights(msg.version)
        log.info("serving %s version %d from %s", msg.agent, msg.version, msg.model_path)

    def channel(self) -> Any:
        """This worker's end of the parameter channel, made on first use."""
        if self._channel is None:
            from flexmarl.runtime.params.channel import ParamChannel
            self._channel = ParamChannel(self.channel_config)
        return self._channel

    def _serves_adapter(self, agent: str) -> bool:
        adapters = getattr(self.engine, "adapters", None)  # None: no engine, or one without LoRA slots
        return adapters is not None and adapters.serves(agent)

    def _serves(self, agent: str) -> bool:
        return self.engine is not None and (agent == self.agent or self._serves_adapter(agent))

    def _load_weights(self, msg: protocol.LoadWeights) -> None:
        if msg.lora is not None:
            return self._load_adapter(msg)
        if msg.handle is None:
            raise ValueError(f"weights for {msg.agent} came without a handle; only an adapter loads from a directory")
        if msg.agent != self.agent and self._running:
            raise ValueError(f"weights for {msg.agent} sent to an instance still generating for {self.agent}")
        # Each of the engine's workers receives the bucket itself and verifies it before any
        # loads: a short or corrupt transfer raises and the engine keeps its previous weights.
        # Another agent's weights load in place only when they are a complete set for this
        # engine's architecture (the engine refuses any other set and keeps its weights);
        # the controller then restarts the engine on that agent's model instead.
        # "keep" and "recompute" load between two steps with requests in flight (`_continues`):
        # they go on under the new weights, each token labelled with the version that made it.
        in_flight = msg.in_flight if msg.agent == self.agent and msg.in_flight else "finish"
        self.engine.load_published(msg.handle, rank=msg.rank, config=self.channel_config, in_flight=in_flight,
                                   version=msg.version)
        if msg.agent != self.agent:
            log.info("now serving %s (weights swapped in place, was %s)", msg.agent, self.agent)
        self.agent, self.version = msg.agent, msg.version

    def _load_adapter(self, msg: protocol.LoadWeights) -> None:
        """An adapter agent's new version joins the engine beside the versions in use, or
        ("keep", "recompute") takes the newest one's place, its requests moved to it."""
        if self.engine is None:
            raise RuntimeError(f"no engine is loaded here to take the adapter of {msg.agent}; load its base first")
        if msg.handle is None:  # a frozen adapter agent: its adapter as a PEFT directory wrote it
            from ..adapters import read_adapter

            tensors, lora = read_adapter(msg.adapter_dir)
            self.engine.load_adapter(msg.agent, msg.version, tensors, lora)
            log.info("serving %s as a frozen adapter from %s", msg.agent, msg.adapter_dir)
            return
        tensors = self.channel().receive(msg.handle, rank=msg.rank or None)
        try:
            self.engine.load_adapter(msg.agent, msg.version, tensors, msg.lora, in_flight=msg.in_flight or "finish")
        finally:
            del tensors
            self.channel().release(msg.handle)
        log.info("serving %s version %d as an adapter", msg.agent, msg.version)

    def _load_adapter_dir(self, msg: protocol.LoadAdapter) -> None:
        """An adapter agent's version from a PEFT adapter directory, its files checked first."""
        from safetensors.torch import load_file

        from ..adapters import ADAPTER_WEIGHTS

        if self.engine is None:
            raise RuntimeError(f"no engine is loaded here to take the adapter of {msg.agent}; load its base first")
        verify_files(msg.path, msg.checksums)
        self.engine.load_adapter(msg.agent, msg.version, load_file(f"{msg.path}/{ADAPTER_WEIGHTS}"), msg.lora)
        log.info("serving %s version %d as an adapter from %s", msg.agent, msg.version, msg.path)

    def _start(self, msg: protocol.Generate) -> protocol.Generated | None:
        """Hand a message's groups to the engine, each as one request of n samples; the
        reply carrying the refused ones, if any."""
        refused = []
        for group in msg.groups:
            # An adapter agent's samples run under its adapter at the version asked for (or the newest).
            adapter = dict(adapter=group.agent, adapter_version=group.version) if self._serves_adapter(group.agent) else {}
            engine_id = self._running.next_id()
            try:
                used = self.engine.add(engine_id, group.prompt_ids, group.max_tokens, group.temperature, group.seed,
                                       n=group.n, top_p=group.top_p, top_k=group.top_k, stop=group.stop,
                                       stop_token_ids=group.stop_token_ids, ignore_eos=group.ignore_eos,
                                       score_from=group.score_from, score_top_k=group.score_top_k, **adapter)
            except RequestRefused as exc:
                log.warning("%s: %s", group.agent, exc)
                refused.append(protocol.GroupRefused(group.key, group.first, str(exc), group.turn))
                continue
            self._running.started(engine_id, msg.request_id, group, used if adapter else self.version)
        if not refused:
            return None
        return protocol.Generated(msg.request_id, [], self._running.done(msg.request_id), self.load(), refused)

    async def _step(self) -> None:
        t0 = time.perf_counter()
        running = self.engine.running_sequences
        finished = await asyncio.to_thread(self.engine.step)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.step_s += dt
        self.sequence_s += running * dt
        tokens = sum(len(c.token_ids) for c in finished)
        if dt > 0:
            self._rate = 0.9 * self._rate + 0.1 * (tokens / dt) if self._rate else tokens / dt
        for request_id, results in self._running.finished(finished).items():
            await self.reply(protocol.Generated(request_id, results, self._running.done(request_id), self.load()))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self._channel is not None:
            self._channel.close()

