"""The loss on a tiny bigram model (logits of a token = one row of a table), against
gradients worked out by hand: d(-A logp(y | x)) / d row_x = -A (onehot(y) - softmax(row_x / T)) / T.
Each option's hand gradient only needs d(term) / d(logp) per token, written below as `coef`."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from train_batches import as_trained, TrainSample, Turn

from flexmarl.runtime import protocol as p
from flexmarl.workers.trainer.loss import AGGREGATIONS, OFF_POLICY, StepSums, policy_loss

V = 5


class Bigram(torch.nn.Module):
    """Called like a Hugging Face causal LM; the next token depends on the current one only."""

    def __init__(self, seed=0):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.table[input_ids])


def hand_logprob(table, x, y, temperature=1.0):
    row = [v / (temperature or 1.0) for v in table[x].tolist()]
    top = max(row)
    return row[y] - top - math.log(sum(math.exp(v - top) for v in row))


def tokens(s):
    """(sample index, position, context token, target token) of every output token."""
    seq = s.prompt_ids + s.output_ids
    return [(j, seq[len(s.prompt_ids) - 1 + j], y) for j, y in enumerate(s.output_ids)]


def hand_gradient(table, samples, coef):
    """Sum over tokens of coef(i, j, logp) * d logp / d table."""
    grad = torch.zeros(V, V, dtype=torch.float64)
    for i, s in enumerate(samples):
        t = s.temperature or 1.0
        for j, x, y in tokens(s):
            probs = torch.softmax(table[x].double() / t, -1)
            onehot = torch.nn.functional.one_hot(torch.tensor(y), V).double()
            grad[x] += coef(i, j, hand_logprob(table, x, y, s.temperature)) * (onehot - probs) / t
    return grad


def make_samples(model, shift=(), temperature=1.0):
    """Three samples of different lengths; rollout logprobs are the model's own minus `shift`
    (per sample index and position), so the ratio exp(logp - rollout) is exp(shift)."""
    rows = [([1], [2, 3], 1.0), ([4, 0], [1, 1, 2], -0.5), ([3], [0], 0.25)]
    out = []
    for i, (prompt, output, adv) in enumerate(rows):
        s = TrainSample(f"s{i}", prompt, output, adv, [], [0], temperature)
        lps = [hand_logprob(model.table, x, y, temperature) - dict(shift).get((i, j), 0.0)
               for j, x, y in tokens(s)]
        out.append(TrainSample(f"s{i}", prompt, output, adv, lps, [0], temperature))
    return out


def step_gradient(model, batches, options, off_policy=False, clip_ratio=2.0, reference=None):
    """What the optimizer step applies: summed micro-batch gradients / summed denominators."""
    model.zero_grad()
    total = StepSums()
    for batch in batches:
        loss, sums = policy_loss(model, as_trained(batch), options, off_policy, clip_ratio, reference)
        loss.backward()
        total.add(sums)
    return model.table.grad.double() / total.denominator, total


@pytest.mark.parametrize("agg", ["seq_mean", "token_mean", "constant"])
def test_each_aggregation_matches_its_hand_gradient_however_the_batch_is_split(agg):
    model = Bigram()
    samples = make_samples(model)
    n_tokens = sum(len(s.output_ids) for s in samples)
    coef = {  # d(objective) / d(logp of token j of sample i); the objective is a mean over the batch
        "seq_mean": lambda i, j, lp: -samples[i].advantage / len(samples[i].output_ids) / len(samples),
        "token_mean": lambda i, j, lp: -samples[i].advantage / n_tokens,
        "constant": lambda i, j, lp: -samples[i].advantage / 8.0 / len(samples),
    }[agg]
    want = hand_gradient(model.table.detach(), samples, coef)
    options = p.LossOptions(agg, constant=8.0)
    for batches in ([samples], [samples[:2], samples[2:]], [[s] for s in samples]):
        got, _ = step_gradient(model, batches, options)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_tables_cover_exactly_the_names_the_protocol_accepts():
    assert set(AGGREGATIONS) == set(p.LossAggregation.__args__)
    assert set(OFF_POLICY) == set(p.OffPolicyCorrection.__args__)


def test_truncated_importance_sampling_caps_the_ratio_and_counts_the_capped_tokens():
    model = Bigram()
    shift = {(0, 0): 1.0, (1, 2): -0.5, (2, 0): 0.3}  # ratios e^1 (capped at 2), e^-0.5, e^0.3
    samples = make_samples(model, shift)

    def coef(i, j, lp):
        ratio = min(math.exp(shift.get((i, j), 0.0)), 2.0)
        return -samples[i].advantage * ratio / len(samples[i].output_ids) / len(samples)

    got, sums = step_gradient(model, [samples], p.LossOptions(off_policy="tis"), off_policy=True, clip_ratio=2.0)
    torch.testing.assert_close(got, hand_gradient(model.table.detach(), samples, coef), rtol=1e-5, atol=1e-7)
    assert sums.clipped == 1 and sums.stats(0.0).clip_frac == pytest.approx(1 / 6)


def test_ppo_clip_zeroes_the_gradient_only_where_the_clipped_branch_wins():
    model = Bigram()
    # sample 0 (A > 0): ratio e^0.5 > 1.2 is clipped; sample 1 (A < 0): e^0.5 is not (the
    # pessimistic unclipped branch wins), e^-0.5 < 0.8 is; sample 2 (A > 0): e^-0.5 is not.
    shift = {(0, 1): 0.5, (1, 0): 0.5, (1, 1): -0.5, (2, 0): -0.5}
    samples = make_samples(model, shift)
    clipped = {(0, 1), (1, 1)}

    def coef(i, j, lp):
        if (i, j) in clipped:
            return 0.0
        return -samples[i].advantage * math.exp(shift.get((i, j), 0.0)) / len(samples[i].output_ids) / len(samples)

    # PPO's epsilon is its own setting (0.2 by default); TIS's cap (clip_ratio) plays no part.
    for cap in (2.0, 1.2):
        got, sums = step_gradient(model, [samples], p.LossOptions(off_policy="ppo_clip"), off_policy=True,
                                  clip_ratio=cap)
        torch.testing.assert_close(got, hand_gradient(model.table.detach(), samples, coef), rtol=1e-5, atol=1e-7)
        assert sums.clipped == 2


def test_on_policy_batches_are_not_corrected_whatever_the_option():
    model = Bigram()
    samples = make_samples(model, {(0, 0): 1.0})
    plain, _ = step_gradient(model, [samples], p.LossOptions(), off_policy=False)
    for name in OFF_POLICY:
        got, sums = step_gradient(model, [samples], p.LossOptions(off_policy=name), off_policy=False)
        assert torch.equal(got, plain) and sums.clipped == 0


def test_kl_penalty_pulls_towards_the_reference_by_the_k3_gradient():
    model, reference = Bigram(seed=0), Bigram(seed=1)
    samples = make_samples(model)
    beta = 0.3

    def coef(i, j, lp):
        _, x, y = tokens(samples[i])[j]
        ref_lp = hand_logprob(reference.table, x, y)
        # d/dlp of beta * (exp(ref - lp) - (ref - lp) - 1) is beta * (1 - exp(ref - lp))
        per_token = -samples[i].advantage + beta * (1 - math.exp(ref_lp - lp))
        return per_token / len(samples[i].output_ids) / len(samples)

    got, sums = step_gradient(model, [samples], p.LossOptions(kl_coef=beta), reference=reference)
    torch.testing.assert_close(got, hand_gradient(model.table.detach(), samples, coef), rtol=1e-5, atol=1e-7)
    assert reference.table.grad is None  # the reference stays frozen
    ref_kl = sum(math.exp(d) - 1 - d for d in (
        hand_logprob(reference.table, x, y) - hand_logprob(model.table, x, y)
        for s in samples for _, x, y in tokens(s)))
    assert sums.ref_kl == pytest.approx(ref_kl, rel=1e-5)


def test_tokens_are_scored_at_the_temperature_they_were_sampled_at():
    model = Bigram()
    samples = make_samples(model, temperature=0.7)  # the sampler's logprobs are of logits / 0.7
    got, sums = step_gradient(model, [samples], p.LossOptions(), off_policy=True)
    stats = sums.stats(0.0)
    # The trainer's logprobs equal the sampler's: every importance ratio is 1.
    assert stats.logprob_abs_diff < 1e-6 and abs(stats.rollout_kl) < 1e-6 and stats.clip_frac == 0
    coef = lambda i, j, lp: -samples[i].advantage / len(samples[i].output_ids) / len(samples)
    torch.testing.assert_close(got, hand_gradient(model.table.detach(), samples, coef), rtol=1e-5, atol=1e-7)
    # Scored at temperature 1 instead, they would not match.
    unscaled = [TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage, s.rollout_logprobs,
                              s.versions) for s in samples]
    _, sums = step_gradient(model, [unscaled], p.LossOptions(), off_policy=True)
    assert sums.stats(0.0).logprob_abs_diff > 0.1


def test_greedy_samples_are_scored_unscaled():
    model = Bigram()
    greedy = make_samples(model, temperature=0.0)
    _, sums = step_gradient(model, [greedy], p.LossOptions(), off_policy=True)
    assert sums.stats(0.0).logprob_abs_diff < 1e-6


def test_step_stats_on_a_tiny_batch_are_what_they_say():
    model = Bigram()
    shift = {(0, 0): 0.6, (1, 1): -0.4}  # trainer minus sampler logprob, d, on two tokens
    samples = make_samples(model, shift)
    samples[2] = TrainSample("s2", [3], [0], 0.25, [], [0])  # no sampler logprobs: not compared
    loss, sums = policy_loss(model, as_trained(samples), p.LossOptions(), True, 2.0)
    stats = sums.stats(grad_norm=1.5)
    table = model.table.detach()
    ents = [-(torch.softmax(table[x], -1) * torch.log_softmax(table[x], -1)).sum().item()
            for s in samples for _, x, _ in tokens(s)]
    ds = [shift.get((i, j), 0.0) for i in range(2) for j in range(len(samples[i].output_ids))]
    assert stats.samples == 3 and stats.tokens == 6
    assert stats.response_len_mean == 2.0 and stats.response_len_max == 3
    assert stats.entropy == pytest.approx(sum(ents) / 6, rel=1e-5)
    assert stats.logprob_abs_diff == pytest.approx(sum(map(abs, ds)) / 5, rel=1e-5)
    assert stats.rollout_kl == pytest.approx(sum(math.exp(d) - 1 - d for d in ds) / 5, rel=1e-5)
    assert stats.clip_frac == 0.0  # e^0.6 < 2
    assert stats.loss == pytest.approx(loss.item() / 3) and stats.grad_norm == 1.5
    assert stats.ref_kl == 0.0


def test_step_sums_survive_the_round_trip_through_tensors():
    sums = StepSums(samples=3, tokens=7, denominator=3, loss=-0.25, length_max=4, clipped=1)
    assert StepSums.from_tensors(sums.to_tensors()) == sums


def test_a_conversation_trains_only_the_agents_own_tokens_under_its_loss_mask():
    """Output [2, 3, 1, 4]: the agent wrote 2 and 4; 3, 1 were appended between its turns
    (another agent's message). Only the masked-in tokens carry gradient and count."""
    model = Bigram(seed=3)
    full = TrainSample("c", [1], [2, 3, 1, 4], 1.0, [], [0, 0], 1.0, [1, 0, 0, 1])
    grad, sums = step_gradient(model, [[full]], p.LossOptions(agg="token_mean"))
    own = {0, 3}
    expected = hand_gradient(model.table, [full], lambda i, j, lp: -1.0 if j in own else 0.0) / len(own)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    assert sums.tokens == 2 and sums.length_max == 2


def correction_gradient(name, shift, coef, **options):
    """The step gradient of correction `name` on make_samples(shift), against the hand
    gradient whose d(objective)/d(logp of token j of sample i) is coef(samples, i, j)."""
    model = Bigram()
    samples = make_samples(model, shift)
    got, sums = step_gradient(model, [samples], p.LossOptions(off_policy=name, **options), off_policy=True)
    want = hand_gradient(model.table.detach(), samples, lambda i, j, lp: coef(samples, i, j))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    return sums


def per_sample(samples, i):
    return 1 / len(samples[i].output_ids) / len(samples)  # seq_mean's share of a token


def test_dual_clip_ppo_bounds_a_negative_advantage_term_at_c_times_the_advantage():
    # sample 1 (A = -0.5): ratio e^1.5 = 4.48 > c = 3, so its term is c A (no gradient);
    # e^0.5 = 1.65 < c keeps PPO's pessimistic r A.
    shift = {(1, 0): 1.5, (1, 1): 0.5}
    ratio = lambda i, j: math.exp(shift.get((i, j), 0.0))  # noqa: E731
    coef = lambda s, i, j: 0.0 if (i, j) == (1, 0) else -s[i].advantage * ratio(i, j) * per_sample(s, i)  # noqa: E731
    sums = correction_gradient("ppo_clip", shift, coef, dual_clip=3.0)
    assert sums.clipped == 1


def test_token_masked_importance_sampling_masks_tokens_whose_ratio_leaves_the_bounds():
    shift = {(0, 0): 1.0, (1, 2): -1.0, (2, 0): 0.3}  # e^1 > 2 and e^-1 < 0.5 masked; e^0.3 kept
    ratio = lambda i, j: math.exp(shift.get((i, j), 0.0))  # noqa: E731
    inside = lambda i, j: 0.5 <= ratio(i, j) <= 2.0  # noqa: E731
    coef = lambda s, i, j: -s[i].advantage * ratio(i, j) * per_sample(s, i) if inside(i, j) else 0.0  # noqa: E731
    sums = correction_gradient("token_mis", shift, coef, is_low=0.5, is_high=2.0)
    assert sums.clipped == 2


def test_sequence_masked_importance_sampling_weights_by_the_whole_ratio_and_masks_whole_samples():
    # sample 0: R = e^(0.4 + 0.5) = 2.46 > 2, masked whole; sample 1: R = e^(0.3 - 0.1) kept.
    shift = {(0, 0): 0.4, (0, 1): 0.5, (1, 0): 0.3, (1, 2): -0.1}
    seq = lambda s, i: math.exp(sum(shift.get((i, j), 0.0) for j in range(len(s[i].output_ids))))  # noqa: E731
    coef = lambda s, i, j: 0.0 if seq(s, i) > 2.0 else -s[i].advantage * seq(s, i) * per_sample(s, i)  # noqa: E731
    sums = correction_gradient("seq_mis", shift, coef)
    assert sums.clipped == 2  # both tokens of sample 0


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # s_i = exp(mean shift): sample 0 (A > 0) e^(1e-4) inside [1 - 3e-4, 1 + 4e-4], trained
    # with weight s; sample 1 (A < 0) e^(-0.01 / 3) below 1 - 3e-4: clipped, no gradient;
    # sample 2 (A > 0) e^(-0.01) is low but A > 0: PPO's pessimistic branch keeps it.
    shift = {(0, 0): 1e-4, (0, 1): 1e-4, (1, 1): -0.01, (2, 0): -0.01}
    s_of = lambda s, i: math.exp(sum(shift.get((i, j), 0.0) for j in range(len(s[i].output_ids)))  # noqa: E731
                                 / len(s[i].output_ids))
    coef = lambda s, i, j: 0.0 if i == 1 else -s[i].advantage * s_of(s, i) * per_sample(s, i)  # noqa: E731
    sums = correction_gradient("gspo", shift, coef)
    assert sums.clipped == 3  # every token of sample 1


def test_cispo_keeps_every_tokens_gradient_under_a_clipped_detached_weight():
    # e^1.5 = 4.48 is clipped to 1 + 2 = 3 (and counted); e^-2 stays (no lower bound), e^0.5 stays.
    shift = {(0, 0): 1.5, (1, 0): -2.0, (2, 0): 0.5}
    weight = lambda i, j: min(math.exp(shift.get((i, j), 0.0)), 3.0)  # noqa: E731
    coef = lambda s, i, j: -s[i].advantage * weight(i, j) * per_sample(s, i)  # noqa: E731
    sums = correction_gradient("cispo", shift, coef, cispo_eps_high=2.0)
    assert sums.clipped == 1


def hand_turn_logprob(table, x, y, temperature, top_k=0, top_p=1.0):
    """vLLM's distribution worked out by hand: logits / T, the k largest, then the most
    likely tokens until their probability reaches top_p, renormalised."""
    row = [v / temperature for v in table[x].tolist()]
    order = sorted(range(V), key=lambda t: -row[t])
    kept = order[:top_k] if 0 < top_k < V else order
    z = [math.exp(row[t]) for t in kept]
    probs = [v / sum(z) for v in z]
    mass, cut = 0.0, []
    for t, q in zip(kept, probs):
        cut.append(t)
        mass += q
        if mass >= top_p:
            break
    if y not in cut:
        return float("-inf")
    return row[y] - math.log(sum(math.exp(row[t]) for t in cut))


def test_each_turn_of_a_conversation_is_scored_under_its_own_distribution():
    """Output [2, 3, a, b]: turn 1 wrote 2 at T=1; 3 was appended; turn 2 wrote a, b at
    T=0.3 with top_k=3. The sampler's logprobs are each turn's own; the trainer's equal them."""
    model = Bigram(seed=3)
    table = model.table.detach()
    a = int(table[3].argmax())  # tokens inside turn 2's top 3, as its sampler would draw
    b = int(table[a].argsort(descending=True)[1])
    output = [2, 3, a, b]
    lp = [hand_turn_logprob(table, 1, 2, 1.0), 0.0, hand_turn_logprob(table, 3, a, 0.3, top_k=3),
          hand_turn_logprob(table, a, b, 0.3, top_k=3)]
    turn2 = Turn(2, 0.3, 1.0, 3)
    sample = TrainSample("c", [1], output, 1.0, lp, [0, 0], 1.0, [1, 0, 1, 1], turns=[turn2])
    _, sums = step_gradient(model, [[sample]], p.LossOptions(off_policy="ppo_clip"), off_policy=True)
    stats = sums.stats(0.0)
    assert stats.logprob_abs_diff < 1e-6 and stats.clip_frac == 0 and sums.compared == 3
    # All scored at the last turn's settings instead (one temperature per sample), they would not match.
    flat = TrainSample("c", [1], output, 1.0, lp, [0, 0], 0.3, [1, 0, 1, 1], top_k=3)
    _, sums = step_gradient(model, [[flat]], p.LossOptions(), off_policy=True)
    assert sums.stats(0.0).logprob_abs_diff > 0.1


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.8, 0, 0.7), (0.8, 5, 1.0), (0.7, 3, 0.9), (1.0, 2, 0.5)])
def test_top_k_and_top_p_samples_are_scored_under_the_truncated_distribution(temperature, top_k, top_p):
    model = Bigram(seed=5)
    table = model.table.detach()
    rows = [([1], [2, 3]), ([4, 0], [1, 1, 2]), ([3], [0])]
    samples = []
    for i, (prompt, drawn) in enumerate(rows):
        output = []  # the sampler only draws kept tokens: each the most likely after the last
        for _ in drawn:
            output.append(int(table[(prompt + output)[-1]].argmax()))
        s = TrainSample(f"s{i}", prompt, output, 1.0 - i, [], [0], temperature, [], top_p, top_k)
        lps = [hand_turn_logprob(table, x, y, temperature, top_k, top_p) for _, x, y in tokens(s)]
        samples.append(TrainSample(f"s{i}", prompt, output, 1.0 - i, lps, [0], temperature, [], top_p, top_k))
    _, sums = step_gradient(model, [samples], p.LossOptions(off_policy="ppo_clip"), off_policy=True)
    assert sums.stats(0.0).logprob_abs_diff < 1e-6 and sums.clipped == 0


@pytest.mark.parametrize("agg", ["seq_mean", "token_mean"])
def test_a_global_batch_cut_by_tokens_or_by_samples_gives_the_same_step_gradient(agg):
    """pipeline.micro_batch_tokens moves only where the global batch is cut: gradients
    accumulate, and the step divides once by the summed denominator."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flexmarl.controller.state.decisions import groups_in_micro_batch

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).float()
    g = torch.Generator().manual_seed(3)
    groups = []
    for i, (prompt_len, outputs) in enumerate([(3, [2, 30, 5]), (12, [1, 1]), (2, [40, 3, 9, 8]), (7, [6])]):
        prompt = torch.randint(1, 50, (prompt_len,), generator=g).tolist()
        groups.append([TrainSample(f"g{i}/{j}", prompt, torch.randint(1, 50, (n,), generator=g).tolist(),
                                     float(j % 2) - 0.5, [], [0]) for j, n in enumerate(outputs)])

    def cut(sizes, limit):
        micro_batches, at = [], 0
        while at < len(groups):
            n = groups_in_micro_batch(sizes[at:], limit)
            micro_batches.append([s for group in groups[at:at + n] for s in group])
            at += n
        return micro_batches

    by_samples = cut([len(group) for group in groups], 4)
    by_tokens = cut([len(group[0].prompt_ids) + sum(len(s.output_ids) for s in group) for group in groups], 60)
    assert [len(mb) for mb in by_samples] == [3, 2, 4, 1] and [len(mb) for mb in by_tokens] == [5, 4, 1]
    options = p.LossOptions(agg=agg)
    grads = []
    for micro_batches in (by_samples, by_tokens):
        model.zero_grad()
        total = StepSums()
        for mb in micro_batches:
            loss, sums = policy_loss(model, as_trained(mb), options, False, 2.0)
            loss.backward()
            total.add(sums)
        grads.append([q.grad / total.denominator for q in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- decoupled PPO and distillation


def proximal_of(model, table):
    """The proximal policy as the trainer gives it: `table` in the model's place in a `with`."""
    from flexmarl.workers.trainer.proximal import PreviousWeights

    previous = PreviousWeights()
    previous.tensors = {"table": table}
    return lambda: previous.in_place(model)


def test_decoupled_ppo_clips_around_the_proximal_policy_and_masks_large_behaviour_weights():
    """u = pi / pi_prox, w = pi_prox / mu: the term is w * -min(u A, clip(u) A), its
    gradient -w u A where the unclipped branch wins, 0 where the clipped one does or where
    w exceeds the cap."""
    model = Bigram(seed=0)
    before = model.table.detach().clone()
    prox_table = model.table.detach() + 0.3 * torch.randn(V, V, generator=torch.Generator().manual_seed(9))
    # mu = pi_prox - behaviour shift: w = e^shift; (1, 1): e^2 = 7.4 above the cap 5, masked
    behaviour = {(0, 0): 0.4, (1, 1): 2.0, (2, 0): -0.7}
    rows = [([1], [2, 3], 1.0), ([4, 0], [1, 1, 2], -0.5), ([3], [0], 0.25)]
    samples = []
    for i, (prompt, output, adv) in enumerate(rows):
        s = TrainSample(f"s{i}", prompt, output, adv, [], [0])
        lps = [hand_logprob(prox_table, x, y) - behaviour.get((i, j), 0.0) for j, x, y in tokens(s)]
        samples.append(TrainSample(f"s{i}", prompt, output, adv, lps, [0]))
    eps, cap = 0.2, 5.0
    counted = {"clipped": 0}

    def coef(i, j, lp):
        _, x, y = tokens(samples[i])[j]
        u = math.exp(lp - hand_logprob(prox_table, x, y))
        w = math.exp(behaviour.get((i, j), 0.0))
        a = samples[i].advantage
        clipped = min(max(u, 1 - eps), 1 + eps) * a < u * a
        counted["clipped"] += clipped or w > cap
        return 0.0 if clipped or w > cap else -w * u * a / len(samples[i].output_ids) / len(samples)

    options = p.LossOptions(off_policy="decoupled", clip_eps=eps, behav_weight_cap=cap)
    model.zero_grad()
    loss, sums = policy_loss(model, as_trained(samples), options, True, 2.0, proximal=proximal_of(model, prox_table))
    loss.backward()
    want = hand_gradient(model.table.detach(), samples, coef)
    torch.testing.assert_close(model.table.grad.double() / sums.denominator, want, rtol=1e-5, atol=1e-7)
    assert sums.clipped == counted["clipped"] and counted["clipped"] >= 2  # the cap and the trust region both bit
    assert torch.equal(model.table.detach(), before)  # and the model's own weights are back
    value = 0.0
    for i, s in enumerate(samples):
        terms = []
        for j, x, y in tokens(s):
            u = math.exp(hand_logprob(model.table, x, y) - hand_logprob(prox_table, x, y))
            w = math.exp(behaviour.get((i, j), 0.0))
            objective = min(u * s.advantage, min(max(u, 1 - eps), 1 + eps) * s.advantage)
            terms.append(0.0 if w > cap else -w * objective)
        value += sum(terms) / len(terms)
    assert loss.item() == pytest.approx(value, rel=1e-5)


def test_decoupled_ppo_without_a_previous_version_takes_the_trained_weights_as_proximal():
    """At version 0 (or on a trainer the state just moved to) u = 1: the gradient is the
    behaviour-weighted policy gradient, w = pi / mu masked above the cap."""
    shift = {(0, 0): 1.0, (1, 2): 1.7, (2, 0): -0.3}  # w = e^shift; e^1.7 = 5.5 above the cap
    w = lambda i, j: math.exp(shift.get((i, j), 0.0))  # noqa: E731
    coef = lambda s, i, j: 0.0 if w(i, j) > 5.0 else -s[i].advantage * w(i, j) * per_sample(s, i)  # noqa: E731
    sums = correction_gradient("decoupled", shift, coef)
    assert sums.clipped == 1


def test_the_proximal_weights_are_in_place_only_inside_the_with():
    model = Bigram(seed=0)
    own = model.table.data_ptr()
    other = torch.zeros(V, V)
    with proximal_of(model, other)():
        assert model.table.data_ptr() == other.data_ptr()
    assert model.table.data_ptr() == own
    with pytest.raises(RuntimeError), proximal_of(model, other)():
        raise RuntimeError("a failure while scoring")
    assert model.table.data_ptr() == own


def with_teacher(samples, teacher_table):
    return [TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage, s.rollout_logprobs, s.versions,
                        s.temperature, teacher_logprobs=[hand_logprob(teacher_table, x, y) for _, x, y in tokens(s)])
            for s in samples]


@pytest.mark.parametrize("only", [False, True], ids=["added-to-the-reward", "alone"])
def test_a_teachers_reverse_kl_is_a_per_token_advantage_on_the_students_own_tokens(only):
    """d = logp - teacher logp per token; the advantage A - beta d (A left out when alone),
    detached: the gradient of beta * KL(student || teacher) on the student's own samples."""
    model, teacher = Bigram(seed=0), Bigram(seed=4)
    samples = with_teacher(make_samples(model), teacher.table.detach())
    beta = 0.7

    def coef(i, j, lp):
        _, x, y = tokens(samples[i])[j]
        d = lp - hand_logprob(teacher.table, x, y)
        return -((0.0 if only else samples[i].advantage) - beta * d) / len(samples[i].output_ids) / len(samples)

    got, sums = step_gradient(model, [samples], p.LossOptions(teacher_coef=beta, teacher_only=only))
    torch.testing.assert_close(got, hand_gradient(model.table.detach(), samples, coef), rtol=1e-5, atol=1e-7)
    kl = sum(hand_logprob(model.table, x, y) - hand_logprob(teacher.table, x, y)
             for s in samples for _, x, y in tokens(s))
    assert sums.teacher_kl == pytest.approx(kl, rel=1e-5) and sums.stats(0.0).teacher_kl == pytest.approx(kl / 6)
    assert teacher.table.grad is None


def test_a_capped_teachers_difference_is_clipped_in_the_advantage_only():
    """teacher_kl_cap c: the advantage A - beta * clip(d, -c, c) per token; a clipped token
    still has its gradient through log p, and the step's teacher_kl is the unclipped sum."""
    model, teacher = Bigram(seed=0), Bigram(seed=4)
    samples = with_teacher(make_samples(model), teacher.table.detach())
    beta, cap = 0.7, 1.0  # d per token: -2.826, 0.805, -1.947, 2.2, -2.826, 0.429
    d = lambda i, j: (hand_logprob(model.table, *tokens(samples[i])[j][1:])  # noqa: E731
                      - hand_logprob(teacher.table, *tokens(samples[i])[j][1:]))
    ds = [d(i, j) for i, s in enumerate(samples) for j in range(len(s.output_ids))]
    assert min(ds) < -cap and max(ds) > cap and any(abs(x) < cap for x in ds)  # clipped both ways, and not

    def coef(i, j, lp):
        return -(samples[i].advantage - beta * min(max(d(i, j), -cap), cap)) / len(samples[i].output_ids) / len(samples)

    got, sums = step_gradient(model, [samples], p.LossOptions(teacher_coef=beta, teacher_kl_cap=cap))
    torch.testing.assert_close(got, hand_gradient(model.table.detach(), samples, coef), rtol=1e-5, atol=1e-7)
    assert sums.teacher_kl == pytest.approx(sum(ds), rel=1e-5)


def test_a_teachers_advantage_goes_through_the_off_policy_correction():
    model, teacher = Bigram(seed=0), Bigram(seed=4)
    shift = {(0, 0): 1.0, (1, 1): 0.3}  # TIS: weight min(e^shift, 2)
    samples = with_teacher(make_samples(model, shift), teacher.table.detach())

    def coef(i, j, lp):
        _, x, y = tokens(samples[i])[j]
        a = samples[i].advantage - 0.5 * (lp - hand_logprob(teacher.table, x, y))
        return -a * min(math.exp(shift.get((i, j), 0.0)), 2.0) / len(samples[i].output_ids) / len(samples)

    got, _ = step_gradient(model, [samples], p.LossOptions(teacher_coef=0.5), off_policy=True, clip_ratio=2.0)
    torch.testing.assert_close(got, hand_gradient(model.table.detach(), samples, coef), rtol=1e-5, atol=1e-7)


def test_a_distilled_sample_without_its_teachers_logprobs_is_refused():
    model = Bigram()
    with pytest.raises(ValueError, match=r"came without their teacher's logprobs"):
        policy_loss(model, as_trained(make_samples(model)), p.LossOptions(teacher_coef=1.0), False, 2.0)


def with_teacher_top(samples, teacher_table, k):
    """The samples with their teacher's logprobs and, at each output position, its k most
    likely ids and their logprobs over the whole vocabulary (what its prefill returns)."""
    out = []
    for s in with_teacher(samples, teacher_table):
        ids, lps = [], []
        for _, x, _ in tokens(s):
            row = [hand_logprob(teacher_table, x, y) for y in range(V)]
            best = sorted(range(V), key=lambda y: -row[y])[:k]
            ids += best
            lps += [row[y] for y in best]
        out.append(dataclasses.replace(s, teacher_top_ids=ids, teacher_top_logprobs=lps))
    return out


@pytest.mark.parametrize("k", [3, V], ids=["top-3", "whole-vocabulary"])
@pytest.mark.parametrize("only", [False, True], ids=["added-to-the-reward", "alone"])
def test_a_teachers_top_k_forward_kl_is_a_dense_term_of_the_loss(k, only):
    """teacher_top_k k: per token, beta * sum_j pT_j (log pT_j - log pS_j) over the teacher's
    k ids, pT renormalised over them, pS the student's own; its gradient in the student's
    logits beta * (pS - pT) over the whole vocabulary; the advantage the reward's alone (none
    when alone); averaged over each sample's tokens like the policy term (seq_mean)."""
    model, teacher = Bigram(seed=0), Bigram(seed=4)
    samples = with_teacher_top(make_samples(model), teacher.table.detach(), k)
    beta, table = 0.7, model.table.detach()
    reward = lambda i: 0.0 if only else samples[i].advantage  # noqa: E731

    want_grad = hand_gradient(table, samples, lambda i, j, lp: -reward(i) / len(samples[i].output_ids) / len(samples))
    want_loss = want_kl = 0.0
    for i, s in enumerate(samples):
        for j, x, y in tokens(s):
            ids, lt = s.teacher_top_ids[k * j:k * (j + 1)], s.teacher_top_logprobs[k * j:k * (j + 1)]
            pt = [math.exp(v) / sum(math.exp(u) for u in lt) for v in lt]
            kl = sum(q * (math.log(q) - hand_logprob(table, x, t)) for q, t in zip(pt, ids))
            want_kl += kl
            want_loss += (-reward(i) * hand_logprob(table, x, y) + beta * kl) / len(s.output_ids)
            ps = torch.softmax(table[x].double(), -1)
            pt_vec = torch.zeros(V, dtype=torch.float64).index_put((torch.tensor(ids),), torch.tensor(pt).double())
            want_grad[x] += beta * (ps - pt_vec) / len(s.output_ids) / len(samples)

    options = p.LossOptions(teacher_coef=beta, teacher_only=only, teacher_top_k=k)
    model.zero_grad()
    loss, sums = policy_loss(model, as_trained(samples), options, False, 2.0)
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(model.table.grad.double() / sums.denominator, want_grad, rtol=1e-5, atol=1e-7)
    assert sums.teacher_top_kl == pytest.approx(want_kl, rel=1e-5) and want_kl > 0
    assert sums.stats(0.0).teacher_top_kl == pytest.approx(want_kl / 6, rel=1e-5)
    kl = sum(hand_logprob(table, x, y) - hand_logprob(teacher.table, x, y) for s in samples for _, x, y in tokens(s))
    assert sums.teacher_kl == pytest.approx(kl, rel=1e-5)  # the sampled token's estimate still reported


def test_the_top_k_term_is_zero_where_the_student_is_the_teacher():
    """A student equal to its teacher over the whole vocabulary: no KL and no gradient from it."""
    model = Bigram(seed=0)
    samples = [dataclasses.replace(s, advantage=0.0) for s in with_teacher_top(make_samples(model), model.table.detach(), V)]
    loss, sums = policy_loss(model, as_trained(samples), p.LossOptions(teacher_coef=1.0, teacher_top_k=V), False, 2.0)
    loss.backward()
    assert sums.teacher_top_kl == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(model.table.grad, torch.zeros(V, V), rtol=0, atol=1e-6)


def test_a_distilled_sample_without_its_teachers_top_k_is_refused():
    model, teacher = Bigram(seed=0), Bigram(seed=4)
    samples = with_teacher(make_samples(model), teacher.table.detach())
    with pytest.raises(ValueError, match=r"came without their teacher's top-3 ids and logprobs"):
        policy_loss(model, as_trained(samples), p.LossOptions(teacher_coef=1.0, teacher_top_k=3), False, 2.0)
