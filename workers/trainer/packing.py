"""A micro-batch laid end to end in one row of tokens: no padding, each group's prompt once.

The row: for each group, in the order its first sample comes, its prompt, then each of its
samples' output tokens but the last (an output's last token is only ever predicted, never
an input). A sample names its group (batch.Sample.group: the controller sends a
micro-batch as groups), so the prompts are never compared. Positions restart at 0 with every prompt and an output's go
on from its prompt's length, so each token sits where it would in its sample's own
sequence, and the backward sums every sample's gradient into the one copy of its prompt.

A *segment* is a run of the row whose tokens attend to the same keys: a prompt attends
causally to itself; an output attends to its whole prompt and causally to itself (its
*prefix* is its prompt). Segments follow each other in the row and cover it;
packed_attention.py turns them into kernel calls.

`predictor[i, j]` is the row whose hidden state predicts output token j of sample i: the
prompt's last token for j = 0, the output's token j - 1 after that.

It is bookkeeping over token ids and lengths (any sequences of ints: lists, arrays or
memoryviews); nothing of models, kernels or losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Segment:
    start: int  # its first row
    length: int
    prefix_start: int = 0  # the rows of its prompt, which it sees whole (length 0: a prompt itself)
    prefix_length: int = 0


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T]
    segments: tuple[Segment, ...]
    predictor: torch.Tensor  # [n, W]: row predicting output token j of sample i (0 past its output)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: Any) -> PackedBatch:
        return PackedBatch(self.input_ids.to(device), self.position_ids.to(device), self.segments,
                           self.predictor.to(device))

    @classmethod
    def of(cls, samples: Sequence[Any]) -> PackedBatch:
        """The row of `samples` (each with `group`, `prompt_ids` and `output_ids`; no empty
        prompt): a group's members share the prompt of its first."""
        by_group: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            by_group.setdefault(s.group, []).append(i)
        width = max(1, max(len(s.output_ids) for s in samples))
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        predictor = [[0] * width for _ in samples]
        for members in by_group.values():
            prompt = list(samples[members[0]].prompt_ids)
            prompt_start = len(ids)
            segments.append(Segment(prompt_start, len(prompt)))
            ids += prompt
            positions += range(len(prompt))
            for i in members:
                inputs = list(samples[i].output_ids[:-1])
                start = len(ids)
                row = predictor[i]
                row[0] = prompt_start + len(prompt) - 1
                row[1:len(inputs) + 1] = range(start, start + len(inputs))
                if inputs:
                    segments.append(Segment(start, len(inputs), prompt_start, len(prompt)))
                    ids += inputs
                    positions += range(len(prompt), len(prompt) + len(inputs))
        return cls(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), tuple(segments),
                   torch.tensor(predictor, dtype=torch.long))
