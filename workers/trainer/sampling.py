"""The distribution a sampler drew a token from, rebuilt from the trained logits.

vLLM's sampler (v1, `Sampler.sample` and `apply_top_k_top_p`) turns a position's logits
into the distribution it samples from in this order: divide by the temperature (a
temperature below 1e-5 is greedy: unscaled and uncut); keep the top_k largest (every
logit equal to the k-th largest too; k = 0 or >= the vocabulary keeps all); over what is
left, sort by probability ascending and drop each token whose cumulative probability is
<= 1 - top_p, never the most likely one; then renormalise. Its logprobs with
`logprobs_mode="processed_logprobs"` (what workers/rollout/engine.py asks for) are log_softmax of
exactly that. `sampler_log_probs` computes the same from the trainer's logits, with one
difference: the token that was sampled is always kept, so round-off between the engine's
logits and the trainer's at the edge of the kept set can never give a sampled token
probability zero.

It knows TrainSample's sampling fields; nothing of losses, models or workers.
"""

from __future__ import annotations

import torch

from flexmarl.runtime import protocol

from .batch import Sample

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it samples greedily


def turn_settings(samples: list[Sample], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p), each [n, width]: the settings of the turn that output
    position j of sample i belongs to (a sample's first turn is its own fields; `turns`
    take over from their `start`). Greedy turns read as temperature 1, no cut."""
    rows: list[list[tuple[float, int, float]]] = []
    for s in samples:
        turns = [protocol.MemberTurn(0, 0, s.temperature, s.top_p, s.top_k), *s.turns]
        row: list[tuple[float, int, float]] = []
        for i, turn in enumerate(turns):
            end = turns[i + 1].start if i + 1 < len(turns) else width
            greedy = turn.temperature < GREEDY_BELOW
            setting = (1.0, 0, 1.0) if greedy else (turn.temperature, max(turn.top_k, 0), turn.top_p)
            row += [setting] * max(0, min(end, width) - len(row))
        row += [row[-1] if row else (1.0, 0, 1.0)] * (width - len(row))
        rows.append(row)
    table = torch.tensor([[list(x) for x in row] for row in rows], dtype=torch.float64)
    return table[..., 0].float(), table[..., 1].long(), table[..., 2].float()


def truncated(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens vLLM's top-k then top-p cut drops, [R, V] bool, for temperature-scaled
    float32 logits [R, V] and per-row top_k [R] (0: none), top_p [R] (1: none)."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    kth = ascending.gather(1, (vocab - k).unsqueeze(1))
    drop = ascending < kth
    probs = ascending.masked_fill(drop, float("-inf")).softmax(dim=-1)
    below = probs.cumsum(dim=-1) <= (1 - top_p).unsqueeze(1)
    below[:, -1] = False  # the most likely token always stays
    drop |= below & (top_p < 1).unsqueeze(1)
    return torch.zeros_like(drop).scatter(1, order, drop)


def sampler_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                      top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [n, W, V] of the distribution each position was sampled from,
    for logits [n, W, V] and per-position settings [n, W] (`turn_settings`); the gradient
    flows through the kept tokens' logits. `targets` [n, W] are always kept."""
    scaled = logits.float() / temperature.to(logits.device).unsqueeze(-1)
    cut = ((top_k > 0) | (top_p < 1)).to(logits.device)
    if bool(cut.any()):
        rows = scaled.detach()[cut]
        drop_rows = truncated(rows, top_k.to(logits.device)[cut], top_p.to(logits.device)[cut])
        drop_rows.scatter_(1, targets[cut].unsqueeze(1), False)
        drop = torch.zeros(scaled.shape, dtype=torch.bool, device=logits.device)
        drop[cut] = drop_rows
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, -1)


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Per-position entropy [n, W] of log-probabilities [n, W, V] whose cut tokens are -inf."""
    p = log_probs.exp()
    return -(p * log_probs.masked_fill(p == 0, 0.0)).sum(-1)
