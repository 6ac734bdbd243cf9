"""One agent's training pipeline: micro-batches to a trainer, one step, one weight sync.

`AgentPipeline.run()` loops over the global batches in order. For each it
- consumes the store's ready groups of the batch, cut into micro-batches by
  `decisions.form_micro_batches` (async: as soon as a full one is ready, while rollout
  continues; sync: once the batch's rollout has ended), and sends each to the trainer the
  allocator binds the agent to (the gradients accumulate there, weights held fixed);
- waits for: ready groups or the batch's end (`schedule.wait_for_work`), a trainer
  (`allocator.acquire`), the trainer's replies;
- once `decisions.step_due` says the batch is done, sends ONE optimizer step, flushes the
  event log (a crash loses nothing that led to a step), and has the weight sync bring the
  agent's instances to the new version, which unblocks the gate (`schedule.synced_to`);
  then, where a checkpoint is due, has the agent's state saved (before anything of the
  next batch reaches the trainer, so the saved state has no pending gradients);
- produces: one metrics row per step, `MicroBatchFormed` / `MicroBatchTrained` /
  `OptimizerStep` events, and the trained samples' token lists freed.

It does not know other agents, the workflow, or how rollout is routed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.config import PipelineConfig

from . import decisions
from .schedule import BatchSchedule
from .store import ExperienceStore, Sample
from .weight_sync import WeightSync

log = logging.getLogger("flexmarl.pipeline")


@dataclass
class StepTimes:
    rollout_s: float = 0.0
    train_s: float = 0.0
    sync_s: float = 0.0


class AgentPipeline:
    def __init__(self, agent: str, cfg: PipelineConfig, store: ExperienceStore, schedule: BatchSchedule,
                 allocator: Any, weights: WeightSync, server: Any, metrics: Any,
                 emit: Callable[[ev.Event], Any], flush_events: Callable[[], Awaitable[None]],
                 loss: protocol.LossOptions | None = None,
                 checkpoint: Callable[[str, str, int], Awaitable[None]] | None = None) -> None:
        self.agent = agent
        # checkpoint(agent, trainer, step), awaited after a step's sync when one is due:
        # nothing of the next batch was sent yet, so the trainer holds no pending gradients.
        self.checkpoint = checkpoint
        self.loss = loss or protocol.LossOptions()
        self.cfg = cfg
        self.store = store
        self.schedule = schedule
        self.allocator = allocator
        self.weights = weights
        self.server = server  # call(), next_request_id()
        self.metrics = metrics
        self.emit = emit
        self.flush_events = flush_events
        self.overlap = cfg.mode == "async"
        self.samples_trained = 0
        self.tokens_trained = 0

    async def run(self) -> None:
        last_end = time.monotonic()
        for batch in range(self.schedule.first_batch, self.schedule.steps + 1):
            trained, train_s = await self._train_batch(batch)
            t_sync = time.monotonic()
            stats = await self._step_and_sync(batch, trained)
            now = time.monotonic()
            times = StepTimes(self.schedule.batches[batch].rollout_s, train_s, now - t_sync)
            self.metrics.record(batch, self.agent, batch, trained, times, step_s=round(now - last_end, 4),
                                **step_signals(stats))
            last_end = now
            self.store.forget(trained)
            if self.schedule.agent_stepped(batch):
                self.metrics.end_step(batch, self.schedule.steps)

    async def _train_batch(self, batch: int) -> tuple[list[Sample], float]:
        """Sends every micro-batch of `batch` to the trainer; returns the samples and the
        trainer seconds once every micro-batch has been trained."""
        version = batch  # the step trains version batch - 1 into batch
        calls, trained = [], []
        while True:
            complete = self.schedule.rollout_complete(batch)
            for mb in decisions.form_micro_batches(self.store, self.agent, batch, self.cfg.micro_batch, complete,
                                                   self.overlap, self.cfg.max_staleness):
                trained += mb
                # The trainer is bound when the micro-batch is sent (see MicroBatchTrained).
                self.emit(ev.MicroBatchFormed(self.agent, "", version, [s.sample_id for s in mb],
                                              [s.min_version for s in mb]))
                calls.append(asyncio.ensure_future(self._train_micro_batch(version, mb)))
            if decisions.step_due(complete, self.store.ready_samples(self.agent, batch)):
                break
            if self.store.ready_samples(self.agent, batch):
                self.allocator.prefetch(self.agent)  # work is coming: swap in while rollout runs
            await self.schedule.wait_for_work(self.agent)
        try:
            train_s = sum(await asyncio.gather(*calls))
        except BaseException:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            raise
        if not trained:
            log.warning("agent %s has no trainable samples in batch %d (all episodes failed?)", self.agent, batch)
        return trained, train_s

    async def _train_micro_batch(self, version: int, mb: list[Sample]) -> float:
        trainer = await self.allocator.acquire(self.agent)
        try:
            async with self.allocator.slot(trainer, (1, version)):
                reply, _ = await self.server.call(trainer, protocol.TrainMicroBatch(
                    self.server.next_request_id(), self.agent, version, [train_sample(s) for s in mb],
                    self.cfg.max_staleness, self.cfg.clip_ratio, self.loss))
        finally:
            self.allocator.release(self.agent)
        self.emit(ev.MicroBatchTrained(self.agent, trainer, version, len(mb), reply.seconds))
        self.tokens_trained += reply.tokens
        return reply.seconds

    async def _step_and_sync(self, batch: int, trained: list[Sample]) -> protocol.StepStats:
        version = batch
        scale = 1.0 / len(trained) if trained else 0.0
        trainer = await self.allocator.acquire(self.agent)
        try:
            # Priority 0: the step and sync are on the next rollout's critical path.
            async with self.allocator.slot(trainer, (0, version)):
                # The trainer refuses the step unless it accumulated exactly these samples.
                reply, _ = await self.server.call(trainer, protocol.OptimStep(
                    self.server.next_request_id(), self.agent, version, scale, samples=len(trained)))
            self.emit(ev.OptimizerStep(self.agent, trainer, version, len(trained)))
            await self.flush_events()
            self.samples_trained += len(trained)
            async with self.allocator.slot(trainer, (0, version)):
                await self.weights.sync(self.agent, trainer, version)
            if self.checkpoint is not None:
                async with self.allocator.slot(trainer, (0, version)):
                    await self.checkpoint(self.agent, trainer, version)
        finally:
            self.allocator.release(self.agent)
        return reply.stats


def train_sample(s: Sample) -> protocol.TrainSample:
    mask = [] if all(s.mask) else list(s.mask)  # all generated: the default, sent as nothing
    return protocol.TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage, s.logprobs, s.versions,
                                s.temperature, mask)


def step_signals(stats: protocol.StepStats) -> dict[str, float]:
    """The trainer's step statistics as metrics columns (trainer side of the signals:
    loss, gradient norm, entropy, response lengths, sampler-vs-trainer mismatch, clipping)."""
    return {"loss": stats.loss, "grad_norm": stats.grad_norm, "entropy": stats.entropy,
            "response_len_mean": stats.response_len_mean, "response_len_max": stats.response_len_max,
            "logprob_abs_diff": stats.logprob_abs_diff, "rollout_kl": stats.rollout_kl,
            "clip_frac": stats.clip_frac, "ref_kl": stats.ref_kl, "tokens": stats.tokens}
