"""Logits of a micro-batch's output tokens, with each distinct prompt computed once.

A GRPO micro-batch holds whole groups: n samples of one prompt. Running every sample as
prompt + output repeats the prompt's forward and backward n times; when prompts are about as
long as outputs, that is nearly half of the trainer's work. `output_logits` therefore runs
the distinct prompts once (right-padded, causal), copies each prompt's keys and values to
its samples (an index, so the backward sums every sample's gradient into the one prompt
pass), and runs the outputs on top of that cache with their true positions. The logits are
the same as a full pass over prompt + output, up to float round-off: causal attention never
lets a prompt token see anything after it.

Models whose forward takes no `past_key_values` (test doubles, say) get the plain pass over
prompt + output; both strategies return the same output-aligned tensors. Each sample's
prompt must hold at least one token (the engine refuses empty prompts).

It knows TrainSample and the Hugging Face causal-LM call convention; nothing about losses.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from flexmarl.runtime import protocol


def padded(rows: list[list[Any]], width: int, fill: Any, dtype: torch.dtype) -> torch.Tensor:
    """rows right-padded with `fill` to `width`, as one tensor (one call, no per-row tensors)."""
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=dtype)


def output_logits(model: Any, samples: list[protocol.TrainSample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [n, W, V], output ids [n, W], valid [n, W]): logits[i, j] predicts output
    token j of sample i; W is the longest output; `valid` marks real (not padding) tokens."""
    if any(not s.prompt_ids for s in samples):
        raise ValueError("a sample with an empty prompt cannot be scored: its first output token has no context")
    width = max(1, max(len(s.output_ids) for s in samples))
    out_ids = padded([s.output_ids for s in samples], width, 0, torch.long)
    valid = padded([[1] * len(s.output_ids) for s in samples], width, 0, torch.bool)
    # Activation checkpointing turns a model's cache off in training: one pass per sample then.
    shares = _takes_cache(type(model)) and not getattr(model, "is_gradient_checkpointing", False)
    score = _shared_prefix if shares else _full_pass
    return score(model, samples, out_ids, valid), out_ids, valid


@functools.cache
def _takes_cache(model_type: type) -> bool:
    return "past_key_values" in inspect.signature(model_type.forward).parameters


def _full_pass(model: Any, samples: list[protocol.TrainSample], out_ids: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
    """One pass over prompt + output per sample (right-padded)."""
    seqs = [list(s.prompt_ids) + list(s.output_ids) for s in samples]
    width = max(map(len, seqs))
    ids = padded(seqs, width, 0, torch.long)
    mask = padded([[1] * len(q) for q in seqs], width, 0, torch.long)
    logits = model(input_ids=ids, attention_mask=mask).logits
    # Output token j of sample i is predicted at position len(prompt_i) - 1 + j.
    starts = torch.tensor([len(s.prompt_ids) - 1 for s in samples])
    positions = (starts[:, None] + torch.arange(out_ids.shape[1])[None, :]).clamp(max=width - 1)
    return logits.gather(1, positions[:, :, None].expand(-1, -1, logits.shape[-1]))


def _shared_prefix(model: Any, samples: list[protocol.TrainSample], out_ids: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
    """Each distinct prompt once, its cache indexed out to its samples, then the outputs."""
    from transformers.cache_utils import DynamicCache

    rows: dict[tuple[int, ...], int] = {}
    which = torch.tensor([rows.setdefault(tuple(s.prompt_ids), len(rows)) for s in samples])
    prompts = list(rows)
    p_width = max(map(len, prompts))
    p_ids = padded([list(p) for p in prompts], p_width, 0, torch.long)
    p_mask = padded([[1] * len(p) for p in prompts], p_width, 0, torch.long)
    p_len = torch.tensor([len(p) for p in prompts])
    first = model(input_ids=p_ids, attention_mask=p_mask, use_cache=True)
    if first.past_key_values is None:  # this model would not keep a cache: score each sample whole
        return _full_pass(model, samples, out_ids, valid)
    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(first.past_key_values.layers):
        cache.update(layer.keys.index_select(0, which), layer.values.index_select(0, which), index)
    # Prompt padding sits between a short prompt and its output: masked out of attention,
    # and the output's positions continue from the prompt's true length.
    mask = torch.cat([p_mask.index_select(0, which), valid.long()], 1)
    positions = p_len.index_select(0, which)[:, None] + torch.arange(out_ids.shape[1])[None, :]
    rest = model(input_ids=out_ids, attention_mask=mask, past_key_values=cache, position_ids=positions).logits
    # The prompt's last position predicts the first output token; each output token the next.
    last = first.logits[torch.arange(len(prompts)), p_len - 1].index_select(0, which)
    return torch.cat([last[:, None], rest[:, :-1]], 1)
