"""The chosen tokens' log-probabilities and entropies of a micro-batch: packed, the
vocabulary in chunks.

`token_scores(model, samples, scored, temperature, top_k, top_p)` gives, for each output
token marked in `scored` [n, W], its log-probability under the distribution it was sampled
from (sampling.py; with gradient) and that distribution's entropy (detached), both [n, W]
with zeros where nothing was scored. `token_scores_at` gives besides, for given ids at each
scored position (a teacher's top k), the model's unscaled logprob of each (with gradient).

A model with a transformers decoder and output head (`get_decoder()`,
`get_output_embeddings()`: Hugging Face causal LMs, and workers/adapters.py's views):
- its decoder runs the micro-batch packed (packing.py, packed_attention.py): one row with
  no padding, each distinct prompt once;
- the head projects only the hidden states that predict a scored token, CHUNK_ELEMENTS
  logits at a time (by device: a GPU's matmuls want more rows than a CPU's). A chunk's
  logits are made, scored and dropped, and made again in the backward (activation
  checkpointing of the head alone), so at most one chunk's float32 logits exist at any
  time, never the micro-batch's. The price is one more head matmul
  in the backward (none when every scored token fits in one chunk: it is kept).
Any other model (called like a causal LM with `input_ids` and `attention_mask`, returning
`.logits`, such as the tests' doubles), or one whose causal-LM head does more than its
output embedding (HEAD_EXTRAS: soft-capping, scaling), gets one right-padded pass over
prompt + output.

It knows TrainSample and the transformers causal-LM conventions; nothing of losses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from . import packed_attention
from .batch import Sample
from .packing import PackedBatch
from .sampling import entropy, sampler_log_probs

# Logits per chunk of the head: 64 MiB in float32 on a CPU, 512 MiB on a GPU (880 rows
# of a 152k vocabulary: enough for the tensor cores, a few % of an 80 GB card).
CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 27}
# Config fields of causal LMs whose logits are not just the output embedding's product.
HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def padded(rows: list[Any], width: int, fill: Any, dtype: torch.dtype) -> torch.Tensor:
    """rows right-padded with `fill` to `width`, as one tensor (one call, no per-row tensors)."""
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=dtype)


def token_scores(model: Any, samples: list[Sample], scored: torch.Tensor, temperature: torch.Tensor,
                 top_k: torch.Tensor, top_p: torch.Tensor,
                 packed: PackedBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), [n, W] each, of the output tokens where `scored` [n, W] is true,
    under the per-token sampling settings [n, W] (`sampling.turn_settings`). `packed`: the
    samples' `PackedBatch.of`, from a caller that scores them more than once (else made here)."""
    logp, ent, _ = token_scores_at(model, samples, scored, temperature, top_k, top_p, packed)
    return logp, ent


def token_scores_at(model: Any, samples: list[Sample], scored: torch.Tensor, temperature: torch.Tensor,
                    top_k: torch.Tensor, top_p: torch.Tensor, packed: PackedBatch | None = None,
                    at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_scores`'s (logp, entropy), and with `at` [n, W, k] (token ids at each output
    position) the model's logprob of each under its unscaled distribution (temperature 1, no
    cut: log_softmax of the logits), [n, W, k] with gradient, zeros where nothing was scored;
    without `at`, [n, W, 0]."""
    if any(len(s.prompt_ids) == 0 for s in samples):
        raise ValueError("a sample with an empty prompt cannot be scored: its first output token has no context")
    rows, cols = scored.nonzero(as_tuple=True)
    targets = padded([s.output_ids for s in samples], scored.shape[1], 0, torch.long)[rows, cols]
    if packs(model):
        states, head, vocab = packed_states(model, samples, rows, cols, packed), model.get_output_embeddings(), None
    else:
        states, head = padded_logits(model, samples, scored.shape[1])[rows, cols], None
        vocab = states.shape[-1]
    ids = (at if at is not None else torch.zeros((*scored.shape, 0), dtype=torch.long))[rows, cols]
    logp, ent, at_lp = chunked_scores(head, vocab or model.config.vocab_size, states, targets, temperature[rows, cols],
                                      top_k[rows, cols], top_p[rows, cols], ids)
    shape = tuple(scored.shape)
    return (torch.zeros(shape, dtype=logp.dtype, device=logp.device).index_put((rows, cols), logp),
            torch.zeros(shape, dtype=ent.dtype, device=ent.device).index_put((rows, cols), ent),
            torch.zeros((*shape, ids.shape[-1]), dtype=at_lp.dtype, device=at_lp.device).index_put((rows, cols), at_lp))


def packs(model: Any) -> bool:
    """Whether `model` is scored packed: a decoder and head apart, and nothing after the head."""
    config = getattr(model, "config", None)
    return (callable(getattr(model, "get_decoder", None)) and callable(getattr(model, "get_output_embeddings", None))
            and config is not None and not any(getattr(config, extra, None) for extra in HEAD_EXTRAS))


def packed_states(model: Any, samples: list[Sample], rows: torch.Tensor,
                  cols: torch.Tensor, packed: PackedBatch | None = None) -> torch.Tensor:
    """The decoder's final hidden states that predict output token cols[k] of sample rows[k].

    The model is called as a whole, so that what wraps it runs (FSDP gathers its shards);
    its decoder's output is taken on the way, and its head is given no position to project
    (`logits_to_keep` empty): `chunked_scores` projects the ones needed."""
    packed_attention.install(model)
    batch = (packed or PackedBatch.of(samples)).to(rows.device)
    final: list[torch.Tensor] = []
    hook = model.get_decoder().register_forward_hook(lambda module, args, out: final.append(out.last_hidden_state))
    try:
        model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
              attention_mask=packed_attention.no_mask(rows.device), packed=packed_attention.Packed(batch),
              use_cache=False, logits_to_keep=torch.zeros(0, dtype=torch.long, device=rows.device))
    finally:
        hook.remove()
    return final[0][0].index_select(0, batch.predictor[rows, cols])


def padded_logits(model: Any, samples: list[Sample], width: int) -> torch.Tensor:
    """Logits [n, width, V], output-aligned (column j predicts output token j), from one
    right-padded pass over prompt + output per sample."""
    seqs = [list(s.prompt_ids) + list(s.output_ids) for s in samples]
    longest = max(map(len, seqs))
    ids = padded(seqs, longest, 0, torch.long)
    mask = padded([[1] * len(q) for q in seqs], longest, 0, torch.long)
    logits = model(input_ids=ids, attention_mask=mask).logits
    # Output token j of sample i is predicted at position len(prompt_i) - 1 + j.
    starts = torch.tensor([len(s.prompt_ids) - 1 for s in samples])
    positions = (starts[:, None] + torch.arange(width)[None, :]).clamp(max=longest - 1)
    return logits.gather(1, positions[:, :, None].expand(-1, -1, logits.shape[-1]))


def chunked_scores(head: Any, vocab: int, states: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor,
                   ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy) [N] of rows `states` [N, ...]: hidden states through `head`, or logits
    already (head None), CHUNK_ELEMENTS logits at a time; and the unscaled logprobs of `ids`
    [N, k] in each row, [N, k]."""
    step = max(1, CHUNK_ELEMENTS.get(states.device.type, CHUNK_ELEMENTS["cpu"]) // vocab)
    # One chunk holds all of them: its logits are no bigger than a chunk, nothing to recompute.
    recompute = head is not None and torch.is_grad_enabled() and states.requires_grad and targets.shape[0] > step
    logps, entropies, at = [], [], []
    for a in range(0, targets.shape[0], step):
        part = (states[a:a + step], targets[a:a + step], temperature[a:a + step], top_k[a:a + step],
                top_p[a:a + step], ids[a:a + step])
        if recompute:
            logp, ent, at_lp = checkpoint(_chunk_scores, head, *part, use_reentrant=False)
        else:
            logp, ent, at_lp = _chunk_scores(head, *part)
        logps.append(logp)
        entropies.append(ent)
        at.append(at_lp)
    if not logps:  # nothing scored: still part of the graph, so a backward (FSDP's hooks) runs
        empty = states[:, 0].float()
        return empty, empty.detach(), empty[:, None].expand(-1, ids.shape[-1])
    return torch.cat(logps), torch.cat(entropies), torch.cat(at)


def _chunk_scores(head: Any, states: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor,
                  ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = states if head is None else head(states)
    log_probs = sampler_log_probs(logits, targets, temperature, top_k, top_p)
    with torch.no_grad():
        ent = entropy(log_probs)
    # The unscaled distribution's at `ids` (none asked: an empty column, nothing computed).
    at_lp = (torch.log_softmax(logits.float(), -1).gather(-1, ids) if ids.shape[-1]
             else log_probs.new_zeros((ids.shape[0], 0)))
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), ent, at_lp
