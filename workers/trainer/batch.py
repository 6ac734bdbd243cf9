"""A micro-batch as the trainer reads it: the groups the controller sent, their members as samples.

The controller sends a micro-batch as groups (protocol.TrainGroup: a prompt once, every
member's output ids and sampler logprobs packed back to back, an advantage per member).
`samples_of` gives each member as a `Sample` whose token sequences are read-only views of
the message's buffers (nothing is copied or turned into lists here), each naming its group
by its index in the micro-batch, so packing (packing.py) lays a group's prompt once before
its members' outputs without comparing prompts. The loss (loss.py) and scoring
(scoring.py) read samples; a trainer group deals them out to its ranks (group.py).

It is bookkeeping over the message; nothing of models or losses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey


@dataclass(frozen=True, slots=True)
class Sample:
    """One member of a micro-batch's group, as the loss reads it."""

    group: int  # its group's index in the micro-batch: members of one group share their prompt
    key: GroupKey  # its group's key, and its index in the group: who it is (`name`)
    member: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    advantage: float
    rollout_logprobs: Sequence[float]  # the sampler's, per output id (empty: none)
    versions: list[int]  # the oldest policy version of any of its turns
    # The distribution its first turn was sampled from (protocol.TrainGroup's fields of these names).
    temperature: float = 1.0
    loss_mask: Sequence[int] = ()  # per output id: 1 trained, 0 appended; empty: all 1
    top_p: float = 1.0
    top_k: int = 0
    turns: Sequence[protocol.MemberTurn] = ()  # its later turns, each with its own settings
    # On-policy distillation: the teacher's logprob of each output id (empty: no teacher).
    teacher_logprobs: Sequence[float] = ()
    # With teacher_top_k k: the teacher's k most likely ids at each output position and their
    # logprobs, k per output id back to back (empty otherwise).
    teacher_top_ids: Sequence[int] = ()
    teacher_top_logprobs: Sequence[float] = ()

    @property
    def name(self) -> str:
        """The sample's name, for people (error messages): made when one is written, not per sample read."""
        return self.key.sample(self.member)

    def with_advantage(self, advantage: float) -> Sample:
        return dataclasses.replace(self, advantage=advantage)


def samples_of(groups: Sequence[protocol.TrainGroup]) -> list[Sample]:
    """Every member of every group, in order."""
    out: list[Sample] = []
    for index, g in enumerate(groups):
        prompt = _ids(g.prompt_ids)
        ids = _ids(g.output_ids)
        logprobs = memoryview(protocol.native(protocol.LOGPROB_TYPECODE, g.rollout_logprobs)).cast("f")
        mask = memoryview(g.loss_mask).cast("b")
        teacher = memoryview(protocol.native(protocol.LOGPROB_TYPECODE, g.teacher_logprobs)).cast("f")
        top_ids = _ids(g.teacher_top_ids)
        top_lps = memoryview(protocol.native(protocol.LOGPROB_TYPECODE, g.teacher_top_logprobs)).cast("f")
        k = len(top_ids) // max(1, len(ids))  # ids per output id
        turns: dict[int, list[protocol.MemberTurn]] = {}
        for turn in g.turns:
            turns.setdefault(turn.member, []).append(turn)
        start = 0
        for j, (length, advantage, version) in enumerate(zip(g.lengths, g.advantages, g.versions)):
            end = start + length
            out.append(Sample(index, g.key, j, prompt, ids[start:end], advantage,
                              logprobs[start:end] if len(logprobs) else (), [version], g.temperature,
                              mask[start:end] if len(mask) else (), g.top_p, g.top_k, turns.get(j, ()),
                              teacher[start:end] if len(teacher) else (),
                              top_ids[k * start:k * end] if k else (), top_lps[k * start:k * end] if k else ()))
            start = end
    return out


def _ids(data: bytes) -> memoryview:
    return memoryview(protocol.native(protocol.TOKEN_TYPECODE, data)).cast("i")


def train_group(key: GroupKey, prompt_ids: Sequence[int], outputs: Sequence[Sequence[int]],
                advantages: Sequence[float], logprobs: Sequence[Sequence[float]] | None = None,
                versions: Sequence[int] | None = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                masks: Sequence[Sequence[int]] | None = None,
                turns: Sequence[protocol.MemberTurn] = (),
                teacher_logprobs: Sequence[Sequence[float]] | None = None,
                teacher_top: Sequence[tuple[Sequence[int], Sequence[float]]] | None = None) -> protocol.TrainGroup:
    """A group from plain lists, one entry per member (benches and tests; the controller
    sends its store's records): no `logprobs`, none compared; no `versions`, all 0; no
    `masks`, every output id trained; no `teacher_logprobs`, no teacher; no `teacher_top`
    (per member, its teacher's top-k ids and logprobs, k per output id), no top-k."""
    trained = masks is None or all(all(m) for m in masks)
    return protocol.TrainGroup(
        key, protocol.packed(protocol.TOKEN_TYPECODE, prompt_ids), [len(o) for o in outputs],
        protocol.packed(protocol.TOKEN_TYPECODE, [t for o in outputs for t in o]),
        protocol.packed(protocol.LOGPROB_TYPECODE, [lp for lps in logprobs for lp in lps]) if logprobs else b"",
        list(advantages), list(versions) if versions is not None else [0] * len(outputs), temperature, top_p, top_k,
        b"" if trained else bytes(m for mask in masks or () for m in mask), list(turns),
        protocol.packed(protocol.LOGPROB_TYPECODE, [lp for lps in teacher_logprobs for lp in lps])
        if teacher_logprobs else b"",
        protocol.packed(protocol.TOKEN_TYPECODE, [t for ids, _ in teacher_top or () for t in ids]),
        protocol.packed(protocol.LOGPROB_TYPECODE, [lp for _, lps in teacher_top or () for lp in lps]))
