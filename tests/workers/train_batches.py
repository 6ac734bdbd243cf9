"""Micro-batches for the trainer's tests, written one sample at a time.

A test names each sample's prompt, output, advantage, sampler logprobs and sampling
(`TrainSample`, the fields a sample has); `groups_of` packs them into the wire's groups
as the controller sends them (consecutive samples named `GROUP/INDEX` with one prompt form
a group, any other sample a group of its own), `micro_batch` into a TRAIN_MICROBATCH, and
`as_trained` gives what the trainer reads of them (workers/trainer/batch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flexmarl.runtime import protocol as p
from flexmarl.runtime.keys import GroupKey
from flexmarl.workers.trainer.batch import samples_of, train_group


@dataclass
class Turn:
    """A later turn: from output id `start` on, sampled at these settings."""

    start: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class TrainSample:
    sample_id: str
    prompt_ids: list
    output_ids: list
    advantage: float
    rollout_logprobs: list
    versions: list
    temperature: float = 1.0
    loss_mask: list = field(default_factory=list)
    top_p: float = 1.0
    top_k: int = 0
    turns: list = field(default_factory=list)
    teacher_logprobs: list = field(default_factory=list)  # empty: no teacher
    # The teacher's top-k ids and their logprobs, k per output id (empty: none).
    teacher_top_ids: list = field(default_factory=list)
    teacher_top_logprobs: list = field(default_factory=list)


def _group_name(s: TrainSample) -> str:
    name, slash, index = s.sample_id.rpartition("/")
    return name if slash and index.isdigit() else s.sample_id


def groups_of(samples: list[TrainSample]) -> list[p.TrainGroup]:
    runs: list[list[TrainSample]] = []
    for s in samples:
        last = runs[-1][-1] if runs else None
        if (last is not None and _group_name(last) == _group_name(s) != s.sample_id
                and list(last.prompt_ids) == list(s.prompt_ids)
                and (last.temperature, last.top_p, last.top_k) == (s.temperature, s.top_p, s.top_k)
                and bool(last.rollout_logprobs) == bool(s.rollout_logprobs)
                and bool(last.teacher_logprobs) == bool(s.teacher_logprobs)
                and bool(last.teacher_top_ids) == bool(s.teacher_top_ids)):
            runs[-1].append(s)
        else:
            runs.append([s])
    return [train_group(GroupKey("test", "agent", _group_name(run[0])), run[0].prompt_ids, [s.output_ids for s in run],
                        [s.advantage for s in run], [s.rollout_logprobs for s in run] if run[0].rollout_logprobs else None,
                        [min(s.versions) for s in run], run[0].temperature, run[0].top_p, run[0].top_k,
                        [list(s.loss_mask) or [1] * len(s.output_ids) for s in run],
                        [p.MemberTurn(j, t.start, t.temperature, t.top_p, t.top_k) for j, s in enumerate(run)
                         for t in s.turns],
                        [s.teacher_logprobs for s in run] if run[0].teacher_logprobs else None,
                        [(s.teacher_top_ids, s.teacher_top_logprobs) for s in run] if run[0].teacher_top_ids else None)
            for run in runs]


def micro_batch(request_id: int, agent: str, version: int, samples: list[TrainSample], *args, **kwargs):
    return p.TrainMicroBatch(request_id, agent, version, groups_of(samples), *args, **kwargs)


def as_trained(samples: list[TrainSample]):
    """What the trainer's loss reads of these samples, as it reads them off the wire."""
    return samples_of(groups_of(samples))
