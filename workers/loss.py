"""The policy-gradient loss of one micro-batch, and the sums an optimizer step reports.

`policy_loss` scores a micro-batch's output tokens under the distribution they were
sampled from (logits / temperature), builds one loss term per token and reduces them to a
sum over samples, so that micro-batch gradients add up to the global batch's and the
optimizer step divides once (`StepSums.denominator`). The options are tables keyed by the
names in `protocol.LossOptions`: AGGREGATIONS (tokens -> one number per sample, and what
the step divides by) and OFF_POLICY (how a token sampled by an older policy is weighted).

It knows TrainSample and any model whose call returns `.logits`; it knows nothing of
workers, versions, optimizers or the controller.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flexmarl.runtime import protocol

from .scoring import output_logits, padded


# ---------------------------------------------------------------- options as tables


@dataclass(frozen=True)
class Aggregation:
    # (token terms, masked, [B, T]; token mask; options) -> one number per sample, [B]
    reduce: Callable[[torch.Tensor, torch.Tensor, protocol.LossOptions], torch.Tensor]
    # (samples, tokens) of a micro-batch -> its share of what the step divides by
    denominator: Callable[[int, int], float]


AGGREGATIONS: dict[str, Aggregation] = {
    "seq_mean": Aggregation(lambda terms, mask, opt: terms.sum(-1) / mask.sum(-1).clamp(min=1.0),
                            lambda samples, tokens: samples),
    "token_mean": Aggregation(lambda terms, mask, opt: terms.sum(-1),
                              lambda samples, tokens: tokens),
    "constant": Aggregation(lambda terms, mask, opt: terms.sum(-1) / opt.constant,
                            lambda samples, tokens: samples),
}


def truncated_importance_sampling(logp: torch.Tensor, rollout_lp: torch.Tensor, adv: torch.Tensor,
                                  clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-A * min(ratio, clip_ratio) * logp with the weight detached: the policy gradient
    reweighted towards the trained policy, the weight's variance bounded by the cap."""
    ratio = torch.exp(logp.detach() - rollout_lp)
    return -adv * ratio.clamp(max=clip_ratio) * logp, ratio > clip_ratio


def ppo_clip(logp: torch.Tensor, rollout_lp: torch.Tensor, adv: torch.Tensor,
             clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate -min(r A, clip(r, 2 - c, c) A) against the sampler's
    logprobs, so clip_ratio 1.2 is the usual epsilon 0.2. A token is clipped where the
    clipped branch wins: its gradient is zero."""
    if clip_ratio <= 1.0:
        raise ValueError(f"ppo_clip needs clip_ratio > 1 (it clips the ratio to "
                         f"[2 - clip_ratio, clip_ratio]), got {clip_ratio}")
    ratio = torch.exp(logp - rollout_lp)
    plain, clipped = ratio * adv, ratio.clamp(2.0 - clip_ratio, clip_ratio) * adv
    return -torch.minimum(plain, clipped), clipped < plain


def on_policy(logp: torch.Tensor, rollout_lp: torch.Tensor, adv: torch.Tensor,
              clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact GRPO gradient: every token was sampled by the weights being trained."""
    return -adv * logp, torch.zeros_like(logp, dtype=torch.bool)


OffPolicyRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
OFF_POLICY: dict[str, OffPolicyRule] = {"tis": truncated_importance_sampling, "ppo_clip": ppo_clip}


# ---------------------------------------------------------------- what a step reports


@dataclass
class StepSums:
    """Running sums since the last optimizer step. They are part of the training state:
    parked and restored with the weights (`to_tensors` / `from_tensors`), so a step taken
    after a swap still covers, and reports on, every sample trained before it."""

    samples: float = 0.0
    tokens: float = 0.0
    denominator: float = 0.0  # what the step divides the summed gradient by
    loss: float = 0.0
    entropy: float = 0.0
    length_max: float = 0.0
    compared: float = 0.0  # tokens that came with sampler logprobs
    abs_diff: float = 0.0
    rollout_kl: float = 0.0
    clipped: float = 0.0
    ref_kl: float = 0.0

    def add(self, other: StepSums) -> None:
        for f in dataclasses.fields(self):
            merge = max if f.name == "length_max" else (lambda a, b: a + b)
            setattr(self, f.name, merge(getattr(self, f.name), getattr(other, f.name)))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: torch.tensor(getattr(self, f.name), dtype=torch.float64) for f in dataclasses.fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> StepSums:
        return cls(**{name: float(t) for name, t in tensors.items()})

    def stats(self, grad_norm: float) -> protocol.StepStats:
        def per_token(x: float, n: float) -> float:
            return x / n if n else 0.0

        return protocol.StepStats(
            loss=per_token(self.loss, self.denominator), grad_norm=grad_norm,
            entropy=per_token(self.entropy, self.tokens),
            response_len_mean=per_token(self.tokens, self.samples), response_len_max=int(self.length_max),
            logprob_abs_diff=per_token(self.abs_diff, self.compared),
            rollout_kl=per_token(self.rollout_kl, self.compared),
            clip_frac=per_token(self.clipped, self.tokens), ref_kl=per_token(self.ref_kl, self.tokens),
            samples=int(self.samples), tokens=int(self.tokens))


STEP_SUM_FIELDS = frozenset(f.name for f in dataclasses.fields(StepSums))


# ---------------------------------------------------------------- the loss


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator exp(x) - 1 - x of KL(q || p), x = log p/q on tokens drawn
    from q: non-negative and unbiased, with far less variance than -x."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


def policy_loss(model: Any, samples: list[protocol.TrainSample], options: protocol.LossOptions,
                off_policy: bool, clip_ratio: float, reference: Any = None) -> tuple[torch.Tensor, StepSums]:
    """The micro-batch's loss, a sum over its samples, and its share of the step's sums.

    Token terms: the policy-gradient term of OFF_POLICY[options.off_policy] when
    `off_policy` (samples may lag the trained weights), else the exact on-policy one;
    plus kl_coef * k3 KL to `reference` (the initial weights) when kl_coef > 0. Every
    tensor is made where the model is (its device is the default inside)."""
    device = next(model.parameters()).device
    # A device context is a torch function mode: every op of the forward then passes
    # through Python (3.5 of the peer bench's 50.8 ms forward/backward, bench/RESULTS.md).
    # The CPU needs none.
    with torch.device(device) if device.type != "cpu" else contextlib.nullcontext():
        return _policy_loss(model, samples, options, off_policy, clip_ratio, reference)


def _policy_loss(model: Any, samples: list[protocol.TrainSample], options: protocol.LossOptions,
                 off_policy: bool, clip_ratio: float, reference: Any) -> tuple[torch.Tensor, StepSums]:
    aggregation = AGGREGATIONS[options.agg]
    rule = OFF_POLICY[options.off_policy] if off_policy else on_policy
    n = len(samples)
    # Output-aligned [n, W]: column j is output token j (scoring.py computes each distinct
    # prompt once). Only the agent's own tokens are trained and compared with the sampler's.
    logits, targets, valid = output_logits(model, samples)
    width = targets.shape[1]
    own = padded([s.loss_mask or [1] * len(s.output_ids) for s in samples], width, 0, torch.float32)
    out_mask = own * valid
    rollout_lp = padded([s.rollout_logprobs or [0.0] * len(s.output_ids) for s in samples], width, 0.0,
                        torch.float32)
    compared = out_mask * torch.tensor([[1.0 if s.rollout_logprobs else 0.0] for s in samples])
    # The sampler's logprobs are of logits / temperature; greedy (0) is scored unscaled.
    temperature = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in samples]).view(n, 1, 1)
    log_probs = torch.log_softmax(logits.float() / temperature, -1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32).unsqueeze(-1)
    terms, clipped = rule(logp, rollout_lp, adv, clip_ratio)
    terms = terms * out_mask
    ref_kl = torch.zeros_like(logp)
    if options.kl_coef > 0:
        with torch.no_grad():
            ref_logits = output_logits(reference, samples)[0].float() / temperature
            ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ref_kl = k3(ref_lp - logp) * out_mask  # gradient flows through logp
        terms = terms + options.kl_coef * ref_kl
    loss = aggregation.reduce(terms, out_mask, options).sum()
    with torch.no_grad():
        d = (logp - rollout_lp) * compared
        tokens = int(out_mask.sum().item())
        sums = StepSums(
            samples=n, tokens=tokens, denominator=aggregation.denominator(n, tokens), loss=float(loss),
            entropy=float((-(log_probs.exp() * log_probs).sum(-1) * out_mask).sum()),
            length_max=int(out_mask.sum(-1).max().item()),
            compared=float(compared.sum()), abs_diff=float(d.abs().sum()),
            rollout_kl=float((k3(d) * compared).sum()), clipped=float((clipped.float() * out_mask).sum()),
            ref_kl=float(ref_kl.sum()))
    return loss, sums
