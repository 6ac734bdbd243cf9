"""Rollout worker: hosts one inference engine (vLLM) serving one agent at a time.

The receive loop only queues; one engine loop (`run`) owns the engine and, between two
engine steps, applies control operations in order (load a model, swap weights in place),
admits newly arrived requests (continuous batching: a batch that arrives mid-generation
joins at the next step) and reports finished samples, grouped per GENERATE request, in
one GENERATED message per request per step. Every sample carries the weights version it
was admitted under, so the controller can check staleness exactly.

Engine calls run on a worker thread, so heartbeats keep flowing during a long load.
It decides nothing: which agent, which requests and which weights come from the controller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from flexmarl.runtime import protocol

from .session import CommandHandler

log = logging.getLogger("flexmarl.rollout")


@dataclass
class _Batch:
    request_id: int
    agent: str
    remaining: set[str]
    tokens: int
    results: list[protocol.GenResult] = field(default_factory=list)


class RolloutHandler(CommandHandler):
    role = "rollout"

    def __init__(self) -> None:
        super().__init__()
        self.engine: Any = None
        self.agent = ""
        self.version = -1
        self._control: list[protocol.Message] = []
        self._admit: list[protocol.Generate] = []
        self._batches: dict[int, _Batch] = {}
        self._sample_batch: dict[str, int] = {}
        self._sample_version: dict[str, int] = {}
        self._wake = asyncio.Event()
        self.tokens_done = 0
        self.busy_s = 0.0
        self._rate = 0.0  # tokens/s, exponentially smoothed over steps
        self._channel: Any = None

    async def handle(self, msg: protocol.Message, buffers: list[Any]) -> None:
        if isinstance(msg, protocol.Generate):
            if msg.agent != self.agent or self.engine is None:
                await self.reply(protocol.Error(msg.request_id, f"this instance serves {self.agent or 'nothing'}, "
                                                                f"not {msg.agent}; reload it first"))
                return
            self._admit.append(msg)
        elif isinstance(msg, (protocol.LoadModel, protocol.LoadWeights)):
            self._control.append(msg)
        else:
            await super().handle(msg, buffers)
            return
        self._wake.set()

    def load(self) -> dict[str, float]:
        queued = sum(len(m.items) for m in self._admit)
        in_flight = sum(len(b.remaining) for b in self._batches.values())
        tokens = sum(b.tokens for b in self._batches.values()) + sum(
            len(it.prompt_ids) + it.max_tokens for m in self._admit for it in m.items)
        return {"queued_requests": float(queued + in_flight), "queued_tokens": float(tokens),
                "tokens_per_s": self._rate, "busy_s": self.busy_s, "version": float(self.version)}

    async def run(self) -> None:
        while True:
            if not (self._control or self._admit or self._batches):
                self._wake.clear()
                await self._wake.wait()
            while self._control:
                await self._apply(self._control.pop(0))
            while self._admit:
                self._start(self._admit.pop(0))
            if self.engine is not None and self.engine.has_unfinished():
                await self._step()

    async def _apply(self, msg: protocol.Message) -> None:
        t0 = time.perf_counter()
        try:
            if isinstance(msg, protocol.LoadModel):
                await asyncio.to_thread(self._load_model, msg)
                reply: protocol.Message = protocol.ModelLoaded(msg.request_id, msg.agent, msg.version,
                                                               time.perf_counter() - t0)
            else:
                await asyncio.to_thread(self._load_weights, msg)
                reply = protocol.WeightsLoaded(msg.request_id, msg.agent, msg.version, time.perf_counter() - t0)
        except Exception as exc:
            log.exception("%s failed", type(msg).__name__)
            reply = protocol.Error(msg.request_id, f"{type(msg).__name__} for {msg.agent} failed: {exc!r}")
        self.busy_s += time.perf_counter() - t0
        await self.reply(reply)

    def _load_model(self, msg: protocol.LoadModel) -> None:
        from .engine import VllmEngine

        if self._batches:
            raise RuntimeError(f"cannot switch models with {len(self._batches)} batches in flight")
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.engine = VllmEngine(msg.model_path, seed=msg.seed, max_model_len=msg.max_model_len)
        self.agent, self.version = msg.agent, msg.version
        log.info("serving %s version %d from %s", msg.agent, msg.version, msg.model_path)

    def _load_weights(self, msg: protocol.LoadWeights) -> None:
        import msgspec

        from flexmarl.runtime.param_channel import ParamChannel, ParamHandle

        if msg.agent != self.agent:
            raise ValueError(f"weights for {msg.agent} sent to an instance serving {self.agent}")
        handle = msgspec.msgpack.decode(msg.handle, type=ParamHandle)
        if self._channel is None:
            self._channel = ParamChannel()
        # Verified before any tensor is handed out: a short or corrupt transfer raises here
        # and the engine keeps its previous weights.
        tensors = self._channel.receive(handle)
        self.engine.load_weights(tensors.items())
        self.version = msg.version

    def _start(self, msg: protocol.Generate) -> None:
        batch = _Batch(msg.request_id, msg.agent, {it.sample_id for it in msg.items},
                       sum(len(it.prompt_ids) + it.max_tokens for it in msg.items))
        self._batches[msg.request_id] = batch
        for it in msg.items:
            self._sample_batch[it.sample_id] = msg.request_id
            self._sample_version[it.sample_id] = self.version
            self.engine.add(it.sample_id, it.prompt_ids, it.max_tokens, it.temperature, it.seed)

    async def _step(self) -> None:
        t0 = time.perf_counter()
        finished = await asyncio.to_thread(self.engine.step)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        done_by_batch: dict[int, list[protocol.GenResult]] = defaultdict(list)
        tokens = 0
        for c in finished:
            request_id = self._sample_batch.pop(c.request_id)
            version = self._sample_version.pop(c.request_id)
            done_by_batch[request_id].append(protocol.GenResult(c.request_id, list(c.token_ids),
                                                                [float(x) for x in c.logprobs], version))
            tokens += len(c.token_ids)
        self.tokens_done += tokens
        if dt > 0:
            self._rate = 0.9 * self._rate + 0.1 * (tokens / dt) if self._rate else tokens / dt
        for request_id, results in done_by_batch.items():
            batch = self._batches[request_id]
            batch.remaining.difference_update(r.sample_id for r in results)
            done = not batch.remaining
            if done:
                del self._batches[request_id]
            await self.reply(protocol.Generated(request_id, batch.agent, results, done, self.load()))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self._channel is not None:
            self._channel.close()
