"""The policy-gradient loss of one micro-batch, and the sums an optimizer step reports.

`policy_loss` scores a micro-batch's output tokens under the distribution they were
sampled from (each turn's temperature, top_k and top_p; sampling.py, through
scoring.py), builds one loss term per token and reduces them to a sum over samples, so
that micro-batch gradients add up to the global batch's and the optimizer step divides
once (`StepSums.denominator`). The options are tables keyed by the
names in `protocol.LossOptions`: AGGREGATIONS (tokens -> one number per sample, and what
the step divides by) and OFF_POLICY (how a token sampled by an older policy is weighted).

It knows TrainSample and what scoring.py scores (a transformers causal LM, or any model
whose call returns `.logits`); it knows nothing of workers, versions, optimizers or the
controller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flexmarl.runtime import protocol

from .batch import Sample
from .packing import PackedBatch
from .sampling import turn_settings
from .scoring import packs, padded, token_scores, token_scores_at

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


@dataclass(frozen=True)
class Tokens:
    """A micro-batch's output tokens, [n, W] each, as the corrections see them."""

    logp: torch.Tensor  # the trained policy's logprobs (with gradient)
    rollout_lp: torch.Tensor  # the sampler's
    adv: torch.Tensor  # [n, 1], or [n, W] where a teacher's reverse KL makes it per token
    mask: torch.Tensor  # 1 where a token is trained
    # The proximal policy's (decoupled PPO: the agent's weights at the previous version);
    # None: the trained weights themselves (an agent at version 0 has no earlier one).
    proximal_lp: torch.Tensor | None = None

    def ratio(self) -> torch.Tensor:
        """pi / mu per token, detached."""
        return torch.exp(self.logp.detach() - self.rollout_lp)

    def sequence_log_ratio(self) -> torch.Tensor:
        """log prod_t pi / mu over each sample's trained tokens, [n, 1], with gradient."""
        return ((self.logp - self.rollout_lp) * self.mask).sum(-1, keepdim=True)


# Each rule: (tokens, options, tis_cap) -> (loss term per token, [n, W]; whether the
# correction clipped or masked that token, [n, W] bool).
OffPolicyRule = Callable[[Tokens, protocol.LossOptions, float], tuple[torch.Tensor, torch.Tensor]]


def on_policy(t: Tokens, opt: protocol.LossOptions, tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact GRPO gradient -A * logp: every token was sampled by the weights being trained."""
    return -t.adv * t.logp, torch.zeros_like(t.logp, dtype=torch.bool)


def truncated_importance_sampling(t: Tokens, opt: protocol.LossOptions,
                                  tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"): -A * min(r, cap) * logp, the weight detached; the policy gradient
    reweighted towards the trained policy, the weight's variance bounded by the cap."""
    r = t.ratio()
    return -t.adv * r.clamp(max=tis_cap) * t.logp, r > tis_cap


def _pessimistic(r: torch.Tensor, adv: torch.Tensor, low: float, high: float,
                 dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, low, high) A), and with dual_clip c > 1 a negative advantage's
    objective bounded below at c A (Ye et al. 2020, dual-clip PPO); flags the tokens whose
    gradient a clip removed."""
    plain, clipped = r * adv, r.clamp(low, high) * adv
    objective = torch.minimum(plain, clipped)
    flagged = clipped < plain
    if dual_clip > 1.0:
        floor = dual_clip * adv
        dual = (adv < 0) & (floor > objective)
        objective = torch.where(dual, floor, objective)
        flagged = flagged | dual
    return -objective, flagged


def ppo_clip(t: Tokens, opt: protocol.LossOptions, tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO (Schulman et al. 2017): -min(r A, clip(r, 1 - eps, 1 + eps) A) against the
    sampler's logprobs, eps = clip_eps; dual-clip with dual_clip > 1."""
    r = torch.exp(t.logp - t.rollout_lp)
    return _pessimistic(r, t.adv, 1.0 - opt.clip_eps, 1.0 + opt.clip_eps, opt.dual_clip)


def token_masked_is(t: Tokens, opt: protocol.LossOptions, tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level MIS (Liu et al. 2025, "When speed kills stability: demystifying RL
    collapse from the training-inference mismatch"): -A * r * logp, the weight detached,
    and a token whose ratio leaves [is_low, is_high] masked (weight 0) instead of truncated."""
    r = t.ratio()
    outside = (r < opt.is_low) | (r > opt.is_high)
    return -t.adv * r.masked_fill(outside, 0.0) * t.logp, outside


def sequence_masked_is(t: Tokens, opt: protocol.LossOptions, tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level MIS (Liu et al. 2025): the weight is the sample's whole ratio
    R = prod_t r_t, detached, and a sample with R outside [is_low, is_high] is masked whole."""
    big = torch.finfo(torch.float32).max
    log_r = t.sequence_log_ratio().detach()
    r = torch.exp(log_r.clamp(max=math.log(big)))
    outside = (log_r < math.log(opt.is_low)) | (log_r > math.log(opt.is_high))
    weight = r.masked_fill(outside, 0.0)
    return -t.adv * weight * t.logp, outside.expand_as(t.logp)


def gspo(t: Tokens, opt: protocol.LossOptions, tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group sequence policy optimization"): PPO's surrogate on
    the length-normalised sequence ratio s = (prod_t r_t)^(1/|y|), clipped to
    [1 - gspo_eps_low, 1 + gspo_eps_high]. Written per token as GSPO-token,
    s_t = sg(s) * pi_t / sg(pi_t): its value is s, its gradient s * grad logp_t, so a
    sample's mean over its tokens (seq_mean) is exactly GSPO's gradient."""
    length = t.mask.sum(-1, keepdim=True).clamp(min=1.0)
    log_s = t.sequence_log_ratio().detach() / length
    s_t = torch.exp(log_s + t.logp - t.logp.detach())
    return _pessimistic(s_t, t.adv, 1.0 - opt.gspo_eps_low, 1.0 + opt.gspo_eps_high)


def cispo(t: Tokens, opt: protocol.LossOptions, tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax 2025, "MiniMax-M1"): -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp,
    every token keeping its gradient; no lower bound (as MiniMax-M1 ran it), the upper
    1 + cispo_eps_high."""
    r = t.ratio()
    high = 1.0 + opt.cispo_eps_high
    return -t.adv * r.clamp(max=high) * t.logp, r > high


def decoupled_ppo(t: Tokens, opt: protocol.LossOptions, tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO (Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement
    learning system"): the trust region is around a proximal policy pi_prox, the agent's
    weights one version before the trained ones, not around the sampler mu. Per token,
    w * -min(u A, clip(u, 1 - eps, 1 + eps) A) with u = pi / pi_prox (dual-clip as
    `ppo_clip`) and the behaviour weight w = pi_prox / mu, detached; a token whose w exceeds
    behav_weight_cap is masked (weight 0), as AReaL filters it."""
    proximal = t.logp.detach() if t.proximal_lp is None else t.proximal_lp
    u = torch.exp(t.logp - proximal)
    terms, clipped = _pessimistic(u, t.adv, 1.0 - opt.clip_eps, 1.0 + opt.clip_eps, opt.dual_clip)
    w = torch.exp(proximal - t.rollout_lp)
    masked = w > opt.behav_weight_cap
    return terms * w.masked_fill(masked, 0.0), clipped | masked


OFF_POLICY: dict[str, OffPolicyRule] = {
    "tis": truncated_importance_sampling, "ppo_clip": ppo_clip, "token_mis": token_masked_is,
    "seq_mis": sequence_masked_is, "gspo": gspo, "cispo": cispo, "decoupled": decoupled_ppo,
}


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
    teacher_kl: float = 0.0  # the student's logprob minus its teacher's, summed over trained tokens
    teacher_top_kl: float = 0.0  # teacher_top_k: the top-k forward KL (`top_k_kl`), summed over trained tokens

    def add(self, other: StepSums) -> None:
        for f in dataclasses.fields(self):
            merge = max if f.name == "length_max" else (lambda a, b: a + b)
            setattr(self, f.name, merge(getattr(self, f.name), getattr(other, f.name)))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: torch.tensor(getattr(self, f.name), dtype=torch.float64) for f in dataclasses.fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> StepSums:
        return cls(**{name: float(t) for name, t in tensors.items()})

    def stats(self, grad_norm: float, skipped: bool = False) -> protocol.StepStats:
        def per_token(x: float, n: float) -> float:
            return x / n if n else 0.0

        return protocol.StepStats(
            loss=per_token(self.loss, self.denominator), grad_norm=grad_norm,
            entropy=per_token(self.entropy, self.tokens),
            response_len_mean=per_token(self.tokens, self.samples), response_len_max=int(self.length_max),
            logprob_abs_diff=per_token(self.abs_diff, self.compared),
            rollout_kl=per_token(self.rollout_kl, self.compared),
            clip_frac=per_token(self.clipped, self.tokens), ref_kl=per_token(self.ref_kl, self.tokens),
            samples=int(self.samples), tokens=int(self.tokens), skipped=skipped,
            teacher_kl=per_token(self.teacher_kl, self.tokens),
            teacher_top_kl=per_token(self.teacher_top_kl, self.tokens))


STEP_SUM_FIELDS = frozenset(f.name for f in dataclasses.fields(StepSums))


# ---------------------------------------------------------------- the loss


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator exp(x) - 1 - x of KL(q || p), x = log p/q on tokens drawn
    from q: non-negative and unbiased, with far less variance than -x."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


# Puts the proximal policy's weights in the model's place for the span of a `with` (the
# trainer's previous version; a test's other table); None: the trained weights are it.
Proximal = Callable[[], contextlib.AbstractContextManager[Any]] | None


def policy_loss(model: Any, samples: list[Sample], options: protocol.LossOptions,
                off_policy: bool, clip_ratio: float, reference: Any = None,
                proximal: Proximal = None) -> tuple[torch.Tensor, StepSums]:
    """The micro-batch's loss, a sum over its samples, and its share of the step's sums.

    Token terms: the policy-gradient term of OFF_POLICY[options.off_policy] when
    `off_policy` (samples may lag the trained weights), else the exact on-policy one;
    plus kl_coef * k3 KL to `reference` (the initial weights) when kl_coef > 0. With
    teacher_coef > 0 the advantage is per token: the reward's (none with teacher_only)
    minus teacher_coef * (logp - the teacher's logprob), detached, whose policy gradient
    is the reverse KL's to the teacher on the student's own tokens (on-policy
    distillation); with teacher_kl_cap > 0 the difference is clipped to [-cap, cap] there
    (the step's teacher_kl stays the unclipped one). With teacher_top_k > 0 the advantage
    is the reward's alone (none with teacher_only) and each trained token's term adds
    teacher_coef * `top_k_kl`, the forward KL from the teacher's top-k next-token
    distribution to the student's at that position, with gradient (dense distillation).
    Decoupled PPO scores the tokens under `proximal` first. Every tensor is made where the model is (its device is the
    default inside)."""
    device = next(model.parameters()).device
    # A device context is a torch function mode: every op of the forward then passes
    # through Python (3.5 of the peer bench's 50.8 ms forward/backward, bench/HISTORY.md).
    # The CPU needs none.
    with torch.device(device) if device.type != "cpu" else contextlib.nullcontext():
        return _policy_loss(model, samples, options, off_policy, clip_ratio, reference, proximal)


def _policy_loss(model: Any, samples: list[Sample], options: protocol.LossOptions,
                 off_policy: bool, clip_ratio: float, reference: Any,
                 proximal: Proximal) -> tuple[torch.Tensor, StepSums]:
    aggregation = AGGREGATIONS[options.agg]
    rule = OFF_POLICY[options.off_policy] if off_policy else on_policy
    n = len(samples)
    # Output-aligned [n, W]: column j is output token j. Only the agent's own tokens are
    # scored, trained and compared with the sampler's.
    width = max(1, max(len(s.output_ids) for s in samples))
    own = padded([s.loss_mask or [1] * len(s.output_ids) for s in samples], width, 0, torch.float32)
    out_mask = own * padded([[1] * len(s.output_ids) for s in samples], width, 0, torch.float32)
    rollout_lp = padded([s.rollout_logprobs or [0.0] * len(s.output_ids) for s in samples], width, 0.0,
                        torch.float32)
    compared = out_mask * torch.tensor([[1.0 if s.rollout_logprobs else 0.0] for s in samples])
    # Each token under the distribution its turn was sampled from (temperature, top_k,
    # top_p), the one the sampler's logprobs are of.
    settings = turn_settings(samples, width)
    # The row the samples are packed in, made once for every pass that scores them
    # (proximal, trained, reference).
    packed = PackedBatch.of(samples) if packs(model) else None
    proximal_lp = None
    if rule is decoupled_ppo and proximal is not None:  # before the trained pass: its graph holds the weights
        with torch.no_grad(), proximal():
            proximal_lp = token_scores(model, samples, out_mask > 0, *settings, packed)[0]
    dense = options.teacher_coef > 0 and options.teacher_top_k > 0
    top_lp = student_top_lp = None
    if dense:  # the student's logprobs of the teacher's top-k ids too
        top_ids, top_lp = teacher_top(samples, width, options.teacher_top_k)
        logp, token_entropy, student_top_lp = token_scores_at(model, samples, out_mask > 0, *settings, packed, top_ids)
    else:
        logp, token_entropy = token_scores(model, samples, out_mask > 0, *settings, packed)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32).unsqueeze(-1)
    teacher_kl = top_kl = None  # no teacher: no tensor of zeros made, summed and read back per micro-batch
    if options.teacher_coef > 0:
        teacher_kl = (logp.detach() - teacher_logprobs(samples, width)) * out_mask
        if dense:  # the reward's advantage alone; the teacher's term is added below
            adv = torch.zeros_like(adv) if options.teacher_only else adv
        else:
            cap = options.teacher_kl_cap
            shaped = teacher_kl.clamp(-cap, cap) if cap > 0 else teacher_kl
            adv = (0.0 if options.teacher_only else adv) - options.teacher_coef * shaped
    terms, clipped = rule(Tokens(logp, rollout_lp, adv, out_mask, proximal_lp), options, clip_ratio)
    terms = terms * out_mask
    if top_lp is not None and student_top_lp is not None:
        top_kl = top_k_kl(top_lp, student_top_lp) * out_mask
        terms = terms + options.teacher_coef * top_kl
    ref_kl = torch.zeros_like(logp)
    if options.kl_coef > 0:
        with torch.no_grad():
            ref_lp = token_scores(reference, samples, out_mask > 0, *settings, packed)[0]
        ref_kl = k3(ref_lp - logp) * out_mask  # gradient flows through logp
        terms = terms + options.kl_coef * ref_kl
    loss = aggregation.reduce(terms, out_mask, options).sum()
    with torch.no_grad():
        d = (logp - rollout_lp) * compared
        tokens = int(out_mask.sum().item())
        sums = StepSums(
            samples=n, tokens=tokens, denominator=aggregation.denominator(n, tokens), loss=float(loss),
            entropy=float((token_entropy * out_mask).sum()),
            length_max=int(out_mask.sum(-1).max().item()),
            compared=float(compared.sum()), abs_diff=float(d.abs().sum()),
            rollout_kl=float((k3(d) * compared).sum()), clipped=float((clipped.float() * out_mask).sum()),
            ref_kl=float(ref_kl.sum()), teacher_kl=float(teacher_kl.sum()) if teacher_kl is not None else 0.0,
            teacher_top_kl=float(top_kl.sum()) if top_kl is not None else 0.0)
    return loss, sums


def top_k_kl(teacher_lp: torch.Tensor, student_lp: torch.Tensor) -> torch.Tensor:
    """Per position, sum_j pT_j (log pT_j - log pS_j) over the teacher's top-k ids j [..., k]:
    pT the teacher's distribution restricted to its k ids and renormalised there (its logprobs
    log-softmaxed over them), pS the student's own probability of each id, not renormalised.
    Leaving pS whole makes the term the cross-entropy from the truncated teacher less that
    teacher's entropy, whose gradient in the student's logits is pS - pT over the whole
    vocabulary: it also pulls down the student's mass outside the teacher's k ids (renormalising
    pS over them would leave that mass free). It is >= 0 (KL to pS renormalised, plus
    -log of pS's mass on the k ids), 0 only where the student puts exactly pT on them; with k
    the vocabulary's size it is the forward KL between the two whole distributions.
    Gradient through `student_lp` only."""
    log_pt = torch.log_softmax(teacher_lp.float(), -1)
    return (log_pt.exp() * (log_pt - student_lp)).sum(-1)


def teacher_top(samples: list[Sample], width: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k most likely ids at each output position and their logprobs, [n, W, k]
    each (id 0 and logprob 0 where there is no output token)."""
    missing = [s.name for s in samples
               if len(s.teacher_top_ids) != k * len(s.output_ids) or len(s.teacher_top_logprobs) != len(s.teacher_top_ids)]
    if missing:
        raise ValueError(f"samples {missing[:3]} came without their teacher's top-{k} ids and logprobs ({k} per "
                         "output token); a distilled agent with teacher_top_k is scored with them")
    ids = padded([s.teacher_top_ids for s in samples], width * k, 0, torch.long).view(len(samples), width, k)
    lps = padded([s.teacher_top_logprobs for s in samples], width * k, 0.0, torch.float32).view(len(samples), width, k)
    return ids, lps


def teacher_logprobs(samples: list[Sample], width: int) -> torch.Tensor:
    """The teacher's logprob of each output token, [n, W] (0 where the token is not the
    agent's own: appended between turns, never trained)."""
    missing = [s.name for s in samples if len(s.teacher_logprobs) != len(s.output_ids)]
    if missing:
        raise ValueError(f"samples {missing[:3]} came without their teacher's logprobs (one per output token); "
                         "a distilled agent's samples are scored by its teacher before they are trained")
    return padded([s.teacher_logprobs for s in samples], width, 0.0, torch.float32)
