"""Attention over a packed micro-batch (packing.py), as a transformers attention implementation.

`install(model)` registers `packed_attention_forward` with transformers' AttentionInterface
under ATTENTION and switches the model's config to it. A call that passes `packed=` (a
PackedBatch) is attended segment by segment, with no padding anywhere; any other call
goes to transformers' own SDPA path, with SDPA's masks (the mask interface is registered
under the same name), exactly as before the switch. The packed call hands the model an
empty 4-D `attention_mask`: transformers takes a 4-D mask as already prepared and builds
none (it would otherwise make a [T, T] mask from the packed positions, and ignore the
prompts shared between segments).

Two kernels, chosen per call (KERNELS):
- "varlen": torch's variable-length FlashAttention (`torch.nn.attention.varlen`, with its
  causal `window_size`: torch 2.11 and later), on CUDA where the attention computes in
  bfloat16 or float16: half-precision inputs, or float32 ones under an autocast to half
  precision (mixed precision: the rotary embedding hands float32 queries over, and
  autocast would run SDPA in half precision anyway, so they are cast as SDPA would cast
  them). Each segment's keys (its prompt, then itself) are gathered into one key row, and
  the causal window is aligned to the end of each key run, so an output sees its whole
  prompt. Grouped-query attention goes to the kernel as it is where it takes
  `enable_gqa`, with its key heads repeated where it does not (torch 2.11, 2.12).
- "sdpa_blocks": torch's scaled_dot_product_attention everywhere else (the CPU, float32).
  Consecutive segments are merged into blocks of at most BLOCK_TOKENS queries, each one
  SDPA call with a boolean mask over its queries and the keys they may see, so that a
  micro-batch of many short samples makes a few calls, not one per sample, while a long
  segment is a call of its own and no call spends much on keys its queries cannot see.
  Keys are repeated for grouped-query attention before the call (faster than SDPA's
  enable_gqa with a mask on the CPU).

Hand-written because no library kernel takes what a GRPO group needs: outputs that share a
prompt computed once (FlashAttention's varlen call and SDPA are the kernels; this module only
says which keys each query sees).

It knows torch, transformers' attention interface and PackedBatch; nothing of losses.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .packing import PackedBatch

ATTENTION = "flexmarl_packed"
BLOCK_TOKENS = 256  # queries per SDPA call when short segments are merged
HALF = (torch.bfloat16, torch.float16)


def install(model: Any) -> None:
    """`model` (anything with a transformers `config`) attends through this module from now on."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, packed_attention_forward)
        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    if model.config._attn_implementation != ATTENTION:
        model.config._attn_implementation = ATTENTION


def no_mask(device: Any) -> torch.Tensor:
    """The `attention_mask` of a packed call: 4-D, so transformers builds none."""
    return torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)


def packed_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                             packed: Packed | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key and value [1, Hkv, T, D];
    returns [1, T, H, D]."""
    if packed is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kernel = choose_kernel(query)
    return KERNELS[kernel](packed, query, key, value, scaling), None


def choose_kernel(query: torch.Tensor) -> str:
    return "varlen" if query.is_cuda and attention_dtype(query) in HALF and has_varlen() else "sdpa_blocks"


def attention_dtype(query: torch.Tensor) -> torch.dtype:
    """What attention computes in: the query's dtype, or autocast's where autocast would
    lower a float32 SDPA call (mixed precision)."""
    kind = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return query.dtype


@functools.cache
def varlen_parameters() -> frozenset[str]:
    """The keyword parameters of this torch's `varlen_attn` (none: it has no such API)."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return frozenset()
    import inspect

    from torch.nn.attention.varlen import varlen_attn as kernel

    return frozenset(inspect.signature(kernel).parameters)


def has_varlen() -> bool:
    """Whether this torch's varlen attention takes a causal window (torch 2.11 and later;
    2.10's `is_causal` does not say how a window of fewer queries than keys aligns)."""
    return "window_size" in varlen_parameters()


# ------------------------------------------------------------------ what each kernel is handed


@dataclass
class Block:
    start: int  # its queries are rows start..stop
    stop: int
    keys: torch.Tensor | None  # the rows it may see, in order; None: its own rows, causally
    mask: torch.Tensor | None  # [queries, keys] bool


class Packed:
    """A PackedBatch on its device, with what the kernels need made once per micro-batch
    (every layer reuses it)."""

    def __init__(self, batch: PackedBatch) -> None:
        self.batch = batch
        self.device = batch.input_ids.device
        self._blocks: list[Block] | None = None
        self._varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None

    def blocks(self) -> list[Block]:
        if self._blocks is None:
            self._blocks = sdpa_blocks(self.batch.segments, self.device)
        return self._blocks

    def varlen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """(key rows, cumulative query lengths, cumulative key lengths, longest query run,
        longest key run): each segment's keys are its prefix, then itself."""
        if self._varlen is None:
            segments = self.batch.segments
            keys = torch.cat([torch.cat([torch.arange(s.prefix_start, s.prefix_start + s.prefix_length),
                                         torch.arange(s.start, s.start + s.length)]) for s in segments])
            q = torch.tensor([0] + [s.length for s in segments]).cumsum(0).to(torch.int32)
            k = torch.tensor([0] + [s.prefix_length + s.length for s in segments]).cumsum(0).to(torch.int32)
            self._varlen = (keys.to(self.device), q.to(self.device), k.to(self.device),
                            max(s.length for s in segments), max(s.prefix_length + s.length for s in segments))
        return self._varlen


def sdpa_blocks(segments: tuple, device: Any, block_tokens: int = BLOCK_TOKENS) -> list[Block]:
    """Consecutive segments merged while their queries fit in `block_tokens`."""
    blocks, first = [], 0
    while first < len(segments):
        last = first + 1
        while (last < len(segments)
               and segments[last].start + segments[last].length - segments[first].start <= block_tokens):
            last += 1
        blocks.append(_block(segments[first:last], device))
        first = last
    return blocks


def _block(segments: tuple, device: Any) -> Block:
    start, stop = segments[0].start, segments[-1].start + segments[-1].length
    if len(segments) == 1 and segments[0].prefix_length == 0:
        return Block(start, stop, None, None)  # a prompt alone: plain causal attention
    # Keys: the prompts of this block's outputs that lie before it, then the block itself.
    outside = sorted({(s.prefix_start, s.prefix_length) for s in segments
                      if s.prefix_length and s.prefix_start < start})
    keys = torch.cat([torch.arange(a, a + n) for a, n in outside] + [torch.arange(start, stop)])
    # Each row's segment, named by its first row; and the prompt an output's rows see whole.
    owner = torch.zeros(stop, dtype=torch.long)
    prefix = torch.full((stop,), -1, dtype=torch.long)
    for a, n in outside:
        owner[a:a + n] = a
    for s in segments:
        owner[s.start:s.start + s.length] = s.start
        if s.prefix_length:
            prefix[s.start:s.start + s.length] = s.prefix_start
    rows = torch.arange(start, stop)
    q_owner, k_owner = owner[rows][:, None], owner[keys][None, :]
    mask = ((q_owner == k_owner) & (keys[None, :] <= rows[:, None])) | (k_owner == prefix[rows][:, None])
    return Block(start, stop, keys.to(device), mask.to(device))


# ------------------------------------------------------------------ the kernels


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[1, Hkv, K, D] -> [1, Hkv * groups, K, D], each key head serving its query heads."""
    if groups == 1:
        return x
    b, h, k, d = x.shape
    return x[:, :, None].expand(b, h, groups, k, d).reshape(b, h * groups, k, d)


def sdpa_block_attention(packed: Packed, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scaling: float | None) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    out = []
    for b in packed.blocks():
        q = query[:, :, b.start:b.stop]
        k = key[:, :, b.start:b.stop] if b.keys is None else key.index_select(2, b.keys)
        v = value[:, :, b.start:b.stop] if b.keys is None else value.index_select(2, b.keys)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q, _repeat_heads(k, groups), _repeat_heads(v, groups), attn_mask=b.mask, is_causal=b.mask is None,
            scale=scaling))
    return torch.cat(out, 2).transpose(1, 2)


def varlen_attn(*args: Any, **kwargs: Any) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn as kernel

    return kernel(*args, **kwargs)


def varlen_attention(packed: Packed, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float | None) -> torch.Tensor:
    keys, cu_q, cu_k, max_q, max_k = packed.varlen()
    dtype = attention_dtype(query)
    q = query[0].transpose(0, 1).to(dtype)  # [T, H, D]
    k = key[0].transpose(0, 1).index_select(0, keys).to(dtype)  # [sum of key runs, Hkv, D]
    v = value[0].transpose(0, 1).index_select(0, keys).to(dtype)
    groups = query.shape[1] // key.shape[1]
    gqa = {}
    if groups > 1 and "enable_gqa" in varlen_parameters():
        gqa = {"enable_gqa": True}
    elif groups > 1:  # query head h is served by key head h // groups, as transformers' repeat_kv does
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    # Window (-1, 0) is causal, aligned to the end of each key run: query j of a segment
    # sees its prefix and its own rows up to j.
    out = varlen_attn(q.contiguous(), k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=(-1, 0), **gqa)
    return out[None]


KERNELS: dict[str, Callable[[Packed, torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]] = {
    "varlen": varlen_attention,
    "sdpa_blocks": sdpa_block_attention,
}
