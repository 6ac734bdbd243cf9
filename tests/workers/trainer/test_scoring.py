"""Packed scoring against a plain computation: each sample alone, prompt + output in one
pass, the whole vocabulary's logits, log-softmax of the sampled distribution. Values and
gradients must agree to float round-off, on micro-batches whose lengths spread wide, for
tied and untied heads, adapters, activation checkpointing and both attention kernels; and
the packed pass must compute no padding and never make the micro-batch's logits."""

import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train_batches import as_trained, TrainSample

from flexmarl.runtime import protocol as p
from flexmarl.workers.trainer.packing import PackedBatch
from flexmarl.workers.trainer.sampling import entropy, sampler_log_probs, turn_settings
from flexmarl.workers.trainer import packed_attention, scoring

VOCAB = 101


def tiny_model(kind: str, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied)
    config, cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[kind]
    return cls(config(**shape)).float()


def spread_batch(seed=0, groups=5, group_size=3):
    """Groups, each one prompt (1-40 tokens), outputs of 1-90 tokens, every kind of sampling
    setting (a group's own), a conversation with appended (untrained) tokens."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.choice([1, 2, 7, 23, 40]))]
        for i in range(group_size):
            n = rng.choice([1, 2, 5, 17, 60, 90])
            out = [rng.randrange(1, VOCAB) for _ in range(n)]
            settings = [dict(), dict(temperature=0.7), dict(temperature=0.9, top_k=12), dict(top_p=0.8)][g % 4]
            mask = [int(j % 7 != 3) for j in range(n)] if (g, i) == (1, 1) else []
            samples.append(TrainSample(f"g{g}/{i}", prompt, out, 1.0, [], [0], loss_mask=mask, **settings))
    return samples


def plain_scores(model, samples, scored, temperature, top_k, top_p, packed=None):
    """Each sample alone, its whole logits, today's arithmetic: (logp, entropy) [n, W]
    (`packed`, the row a packing scorer may be handed, is not used)."""
    logp = torch.zeros(scored.shape)
    ent = torch.zeros(scored.shape)
    for i, s in enumerate(samples):
        ids = torch.tensor([list(s.prompt_ids) + list(s.output_ids)])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(s.prompt_ids) - 1:-1]
        n = len(s.output_ids)
        targets = torch.tensor(s.output_ids)
        log_probs = sampler_log_probs(logits, targets, temperature[i, :n], top_k[i, :n], top_p[i, :n])
        logp = logp.index_put((torch.full((n,), i), torch.arange(n)), log_probs.gather(-1, targets[:, None])[:, 0])
        ent[i, :n] = entropy(log_probs).detach()
    return logp * scored, ent * scored


def scored_mask(samples):
    width = max(len(s.output_ids) for s in samples)
    return scoring.padded([s.loss_mask or [1] * len(s.output_ids) for s in samples], width, 0, torch.bool)


def scores_and_grads(score, model, samples, params):
    scored = scored_mask(samples)
    logp, ent = score(model, as_trained(samples), scored, *turn_settings(as_trained(samples), scored.shape[1]))
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((logp * weights).sum(), params)
    return logp.detach(), ent, grads


def assert_same_as_plain(model, samples, params, names, plain_model=None):
    new = scores_and_grads(scoring.token_scores, model, samples, params)
    old = scores_and_grads(plain_scores, plain_model or model, samples, params)
    torch.testing.assert_close(new[0], old[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(new[1], old[1], rtol=1e-5, atol=2e-5)
    for name, a, b in zip(names, new[2], old[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Three rows of logits per head chunk: every batch here spans many chunks."""
    monkeypatch.setitem(scoring.CHUNK_ELEMENTS, "cpu", 3 * VOCAB)


@pytest.mark.parametrize("kind,tied", [("qwen2", True), ("llama", False)])
def test_packed_scores_and_gradients_equal_each_sample_scored_alone_with_whole_logits(kind, tied):
    model = tiny_model(kind, tied)
    names, params = zip(*model.named_parameters())
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    assert_same_as_plain(model, spread_batch(), params, names)


def test_with_activation_checkpointing_the_scores_and_gradients_are_the_same():
    model = tiny_model("qwen2", tied=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    names, params = zip(*model.named_parameters())
    assert_same_as_plain(model, spread_batch(seed=2), params, names)


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1), enable_gqa=False):
    """FlashAttention's varlen semantics written out, on the CPU."""
    assert window_size == (-1, 0) and q.shape[1] % k.shape[1] == 0
    assert enable_gqa or q.shape[1] == k.shape[1], "fewer key heads than query heads without enable_gqa"
    groups = q.shape[1] // k.shape[1]
    out = []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        qs = q[a:b].transpose(0, 1)
        ks = k[c:d].transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[c:d].transpose(0, 1).repeat_interleave(groups, 0)
        # query i sees keys up to i + (keys - queries): bottom-right aligned
        visible = torch.arange(d - c)[None, :] <= torch.arange(b - a)[:, None] + (d - c) - (b - a)
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible,
                                                                    scale=scale).transpose(0, 1))
    return torch.cat(out)


def test_compiled_norms_and_mlps_give_the_same_scores_and_gradients():
    """compile_layers (trainer setting): each RMSNorm and MLP module compiled in place,
    dynamic shapes; scores and gradients as the same weights' uncompiled (float round-off
    apart: fused kernels sum in another order), and a second batch of other lengths (the
    dynamic shapes) runs too."""
    from flexmarl.workers.precision import compile_layers

    model = tiny_model("qwen2", tied=True)
    norms_and_mlps = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    eager = tiny_model("qwen2", tied=True)
    assert compile_layers(model) == len(norms_and_mlps) == 2 * 2 + 1 + 2  # two per layer's norms, final norm, MLPs
    assert all(m._compiled_call_impl is not None for m in norms_and_mlps)
    names, params = zip(*model.named_parameters())
    samples = spread_batch(seed=6)
    compiled = scores_and_grads(scoring.token_scores, model, samples, params)
    plain = scores_and_grads(scoring.token_scores, eager, samples, list(eager.parameters()))
    torch.testing.assert_close(compiled[0], plain[0], rtol=1e-5, atol=2e-5)
    for name, a, b in zip(names, compiled[2], plain[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    scores_and_grads(scoring.token_scores, model, spread_batch(seed=7, groups=2), params)


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["enable_gqa", "torch-2.11-no-enable_gqa"])
def test_the_varlen_kernels_layout_gives_the_same_scores_and_gradients(monkeypatch, takes_gqa):
    """The CUDA kernel's inputs (each segment's keys gathered: its prompt, then itself;
    cumulative lengths; a causal window aligned to the end of each key run), checked on
    the CPU through a kernel with FlashAttention's varlen semantics written out here. A
    torch whose kernel takes no `enable_gqa` (2.11) is handed the key heads repeated."""
    calls = []
    parameters = {"scale", "window_size"} | ({"enable_gqa"} if takes_gqa else set())

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        assert set(kwargs) <= parameters, f"{set(kwargs) - parameters} is not a parameter of this torch's kernel"
        calls.append(len(cu_q) - 1)
        return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    monkeypatch.setattr(packed_attention, "choose_kernel", lambda query: "varlen")
    monkeypatch.setattr(packed_attention, "varlen_attn", kernel)
    monkeypatch.setattr(packed_attention, "varlen_parameters", lambda: frozenset(parameters))
    model = tiny_model("llama")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    names, params = zip(*model.named_parameters())
    samples = spread_batch(seed=3)
    assert_same_as_plain(model, samples, params, names)
    segments = len(PackedBatch.of(as_trained(samples)).segments)
    assert calls and set(calls) == {segments}


def test_mixed_precision_attends_through_the_varlen_kernel_in_the_autocast_dtype(monkeypatch):
    """Under an autocast to bfloat16 over float32 weights (mixed precision) the queries
    reach attention in float32 (the rotary embedding's cos and sin are float32): the
    kernel is still the half-precision varlen one, handed bfloat16, as autocast would
    hand SDPA. A torch without a causal window in its varlen API keeps SDPA."""
    query = torch.zeros(1, 4, 3, 8)
    assert packed_attention.attention_dtype(query) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed_attention.attention_dtype(query) == torch.bfloat16
        assert packed_attention.attention_dtype(query.bfloat16()) == torch.bfloat16
    seen = []

    def kernel(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return varlen_reference(q, k, v, *args, **kwargs)

    monkeypatch.setattr(packed_attention, "choose_kernel", lambda query: "varlen")
    monkeypatch.setattr(packed_attention, "varlen_attn", kernel)
    model = tiny_model("llama")
    samples = spread_batch(seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scored = scored_mask(samples)
        settings = turn_settings(as_trained(samples), scored.shape[1])
        logp, _ = scoring.token_scores(model, as_trained(samples), scored, *settings)
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    assert torch.isfinite(logp).all()
    monkeypatch.setattr(packed_attention, "varlen_parameters", lambda: frozenset({"scale", "is_causal"}))
    assert not packed_attention.has_varlen()  # torch 2.10: no window, so SDPA everywhere


def test_an_adapter_and_its_base_alone_score_as_the_plain_pass(tmp_path):
    """An adapter on attention, MLP and the head: packed, with the adapter's own gradients;
    and the base with every adapter off (a KL reference), the head's included."""
    from flexmarl.workers.adapters import SharedBase
    from flexmarl.workers.precision import TrainPlacement

    base = tiny_model("llama")
    base.save_pretrained(tmp_path)
    shared = SharedBase(str(tmp_path), TrainPlacement.resolve(p.TrainerSettings(), "cpu"))
    lora = p.LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])
    adapter = shared.add("a", lora, seed=0)
    with torch.no_grad():  # B starts at 0: make the adapter matter
        for _, param in adapter.named_parameters():
            param.normal_(0, 0.1)
    names, params = zip(*adapter.named_parameters())
    assert any("lm_head" in name for name in names)
    samples = spread_batch(seed=4, groups=3)
    assert_same_as_plain(adapter, samples, params, names)
    reference = adapter.reference()  # adapters off: the base as it was saved
    assert scoring.packs(adapter) and scoring.packs(reference)
    with torch.no_grad():
        scored = scored_mask(samples)
        settings = turn_settings(as_trained(samples), scored.shape[1])
        got = scoring.token_scores(reference, as_trained(samples), scored, *settings)[0]
        want = plain_scores(tiny_model("llama"), samples, scored, *settings)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def test_the_decoder_runs_each_prompt_once_and_no_padding():
    model, samples = tiny_model("qwen2"), spread_batch()
    lengths = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: lengths.append(tuple(args[0].shape)))
    scored = scored_mask(samples)
    scoring.token_scores(model, as_trained(samples), scored, *turn_settings(as_trained(samples), scored.shape[1]))
    prompts = {tuple(s.prompt_ids) for s in samples}
    assert lengths == [(1, sum(map(len, prompts)) + sum(len(s.output_ids) - 1 for s in samples))]


class LargestVocabularyTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes with a dimension of the vocabulary's size."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and VOCAB in t.shape:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_the_micro_batchs_vocabulary_logits_is_made_forward_or_backward():
    from flexmarl.workers.trainer.loss import policy_loss

    model, samples = tiny_model("qwen2", tied=True), spread_batch()
    scored_tokens = int(scored_mask(samples).sum())
    with LargestVocabularyTensor() as seen:
        loss, _ = policy_loss(model, as_trained(samples), p.LossOptions(), off_policy=False, clip_ratio=2.0)
        loss.backward()
    # The embedding (and its gradient), or one chunk of logits: 3 rows here, of 610 scored.
    embedding = model.get_input_embeddings().weight.numel()
    assert seen.largest <= max(embedding, scoring.CHUNK_ELEMENTS["cpu"]) < scored_tokens * VOCAB / 10


def test_a_model_without_a_decoder_and_head_apart_gets_one_padded_pass():
    calls = []

    class Table(torch.nn.Module):  # called like a causal LM, nothing more
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB))

        def forward(self, input_ids, attention_mask):
            calls.append(tuple(input_ids.shape))
            return SimpleNamespace(logits=self.table[input_ids])

    model = Table()
    samples = [TrainSample("a", [1, 4, 9], [3, 7], 1.0, [], [0]), TrainSample("b", [2], [5], 1.0, [], [0])]
    scored = scored_mask(samples)
    logp, _ = scoring.token_scores(model, as_trained(samples), scored, *turn_settings(as_trained(samples), 2))
    assert calls == [(2, 5)]  # one pass over prompt + output, the longest 3 + 2
    want = torch.log_softmax(model.table[9], -1)[3]  # output token 0 of "a" is predicted from 9
    torch.testing.assert_close(logp[0, 0], want)
    assert logp[1, 1] == 0  # "b" has one output token


def test_a_sample_with_an_empty_prompt_is_refused():
    sample = TrainSample("s", [], [3], 1.0, [], [0])
    with pytest.raises(ValueError, match="empty prompt"):
        scoring.token_scores(tiny_model("qwen2"), as_trained([sample]), torch.ones(1, 1, dtype=torch.bool),
                             *turn_settings(as_trained([sample]), 1))


@pytest.mark.parametrize("options,off_policy", [(p.LossOptions(), False),
                                                (p.LossOptions(off_policy="ppo_clip", agg="token_mean", kl_coef=0.05),
                                                 True)], ids=["on-policy", "ppo-clip-and-kl"])
def test_the_loss_and_its_gradient_equal_those_of_whole_logits_per_sample(monkeypatch, options, off_policy):
    from flexmarl.workers.trainer import loss as loss_module

    model, reference = tiny_model("qwen2", tied=True), tiny_model("qwen2", tied=True)
    with torch.no_grad():  # the reference (the initial weights) a little apart from the policy
        for q in reference.parameters():
            q.add_(0.02 * torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel())))
    rng = random.Random(7)  # sampler logprobs near the policy's: some ratios clip, most do not
    samples = [TrainSample(s.sample_id, s.prompt_ids, s.output_ids, rng.uniform(-1, 1),
                             [-4.6 + rng.gauss(0, 0.3) for _ in s.output_ids], [0], s.temperature, s.loss_mask,
                             s.top_p, s.top_k) for s in spread_batch(seed=5)]

    def loss_sums_grads():
        model.zero_grad()
        loss, sums = loss_module.policy_loss(model, as_trained(samples), options, off_policy, 2.0, reference)
        loss.backward()
        return loss.detach(), sums, [q.grad.clone() for q in model.parameters()]

    new = loss_sums_grads()
    monkeypatch.setattr(loss_module, "token_scores", plain_scores)
    old = loss_sums_grads()
    torch.testing.assert_close(new[0], old[0], rtol=1e-5, atol=1e-6)
    for field in ("entropy", "abs_diff", "rollout_kl", "clipped", "ref_kl", "tokens", "denominator"):
        assert getattr(new[1], field) == pytest.approx(getattr(old[1], field), rel=1e-5, abs=1e-5), field
    assert old[1].clipped > 0 or not off_policy
    for (name, _), a, b in zip(model.named_parameters(), new[2], old[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_a_micro_batch_with_no_trained_token_still_backpropagates_a_zero_loss():
    """A trainer group's rank must run its backward (FSDP's collectives) whatever it was dealt."""
    from flexmarl.workers.trainer.loss import policy_loss

    model = tiny_model("qwen2")
    sample = TrainSample("s", [1, 2], [3, 4], 1.0, [], [0], loss_mask=[0, 0])
    loss, sums = policy_loss(model, as_trained([sample]), p.LossOptions(), off_policy=False, clip_ratio=2.0)
    loss.backward()
    assert loss.item() == 0 and sums.tokens == 0
    assert all(q.grad is not None and not q.grad.any() for q in model.get_decoder().layers.parameters())


# ---------------------------------------------------------------- decoupled PPO and distillation on real models


def hand_decoupled_distilled_loss(model, samples, proximal_lp, eps, cap, beta):
    """Decoupled PPO with a teacher's reverse KL, written out per sample from each one's
    whole logits (seq_mean): a = A - beta (logp - teacher), u = pi / pi_prox,
    w = pi_prox / mu, term = w * -min(u a, clip(u) a), 0 where w > cap."""
    total = 0.0
    for i, s in enumerate(samples):
        ids = torch.tensor([list(s.prompt_ids) + list(s.output_ids)])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(s.prompt_ids) - 1:-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0]
        prox, mu, teacher = proximal_lp[i], torch.tensor(s.rollout_logprobs), torch.tensor(s.teacher_logprobs)
        a = s.advantage - beta * (lp.detach() - teacher)
        u = torch.exp(lp - prox)
        objective = torch.minimum(u * a, u.clamp(1 - eps, 1 + eps) * a)
        w = torch.exp(prox - mu)
        terms = torch.where(w > cap, torch.zeros_like(w), -w * objective)
        mask = torch.tensor(s.loss_mask or [1] * len(s.output_ids), dtype=torch.float32)
        total = total + (terms * mask).sum() / mask.sum()
    return total


def plain_logprobs(model, samples):
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.output_ids)])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(s.prompt_ids) - 1:-1]
            out.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0])
    return out


def adapter_model(tmp_path):
    from flexmarl.workers.adapters import SharedBase
    from flexmarl.workers.precision import TrainPlacement

    tiny_model("llama").save_pretrained(tmp_path)
    shared = SharedBase(str(tmp_path), TrainPlacement.resolve(p.TrainerSettings(), "cpu"))
    lora = p.LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])
    adapter = shared.add("a", lora, seed=0)
    with torch.no_grad():
        for _, param in adapter.named_parameters():
            param.normal_(0, 0.1)
    return adapter


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama-untied", "adapter"])
def test_decoupled_ppo_with_a_teacher_equals_its_formula_on_whole_logits(kind, tmp_path):
    """The packed, chunked loss of decoupled PPO (the proximal weights put in place by the
    trainer's PreviousWeights) plus a teacher's reverse KL, against the formula written
    out per sample: values and gradients."""
    from flexmarl.workers.trainer.loss import policy_loss
    from flexmarl.workers.trainer.proximal import PreviousWeights

    model = {"qwen2-tied": lambda: tiny_model("qwen2", tied=True), "llama-untied": lambda: tiny_model("llama"),
             "adapter": lambda: adapter_model(tmp_path)}[kind]()
    previous = PreviousWeights()
    previous.keep(model)  # the previous version: the weights now; then the live ones move on
    with torch.no_grad():
        for q in model.parameters():
            q.add_(0.05 * torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel())))
    teacher = tiny_model("qwen2", tied=True)
    with torch.no_grad():
        for q in teacher.parameters():
            q.add_(0.3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel() + 1)))
    rng = random.Random(3)
    base = [s for s in spread_batch(seed=6, groups=3) if not s.loss_mask][:6]
    base = [TrainSample(s.sample_id, s.prompt_ids, s.output_ids[:12], rng.uniform(-1, 1), [], [0]) for s in base]
    teacher_lp = plain_logprobs(teacher, base)
    with previous.in_place(model):
        proximal_lp = plain_logprobs(model, base)
    samples = [TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage,
                           (prox - torch.tensor([rng.gauss(0, 0.6) for _ in prox])).tolist(), [0],
                           teacher_logprobs=t.tolist()) for s, prox, t in zip(base, proximal_lp, teacher_lp)]
    eps, cap, beta = 0.2, 2.0, 0.4
    options = p.LossOptions(off_policy="decoupled", clip_eps=eps, behav_weight_cap=cap, teacher_coef=beta)
    params = list(model.parameters())

    loss, sums = policy_loss(model, as_trained(samples), options, True, 2.0, proximal=lambda: previous.in_place(model))
    got = torch.autograd.grad(loss, params)
    want_loss = hand_decoupled_distilled_loss(model, samples, proximal_lp, eps, cap, beta)
    want = torch.autograd.grad(want_loss, params)
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    assert 0 < sums.clipped < sums.tokens  # some tokens clipped or masked, not all


def top_k_of(teacher, samples, k):
    """Per sample, its teacher's k most likely ids at each output position and their logprobs, flat."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.output_ids)])
            logits = teacher(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(s.prompt_ids) - 1:-1]
            lps, top = torch.log_softmax(logits.float(), -1).topk(k, -1)
            out.append((top.flatten().tolist(), lps.flatten().tolist()))
    return out


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama-untied", "adapter", "chunked"])
def test_a_teachers_top_k_kl_equals_its_formula_on_whole_logits(kind, tmp_path, monkeypatch):
    """The packed, chunked loss with teacher_top_k (the policy term on the reward's advantage
    plus beta * the forward KL from the teacher's top-k distribution, renormalised, to the
    student's log_softmax at those ids) against the formula written out per sample from its
    whole logits: values and gradients ("chunked": the head's logits 7 rows at a time, made
    again in the backward)."""
    from flexmarl.workers.trainer.loss import policy_loss

    if kind == "chunked":
        monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", {"cpu": 7 * VOCAB})

    model = {"qwen2-tied": lambda: tiny_model("qwen2", tied=True), "llama-untied": lambda: tiny_model("llama"),
             "adapter": lambda: adapter_model(tmp_path), "chunked": lambda: tiny_model("llama")}[kind]()
    teacher = tiny_model("qwen2", tied=True)
    with torch.no_grad():
        for q in teacher.parameters():
            q.add_(0.3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel() + 1)))
    rng, k, beta = random.Random(4), 5, 0.6
    base = [s for s in spread_batch(seed=8, groups=3) if not s.loss_mask][:6]
    base = [TrainSample(s.sample_id, s.prompt_ids, s.output_ids[:12], rng.uniform(-1, 1), [], [0]) for s in base]
    teacher_lp = plain_logprobs(teacher, base)
    samples = [TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage, [], [0], teacher_logprobs=t.tolist(),
                           teacher_top_ids=ids, teacher_top_logprobs=lps)
               for s, t, (ids, lps) in zip(base, teacher_lp, top_k_of(teacher, base, k))]
    params = list(model.parameters())

    loss, sums = policy_loss(model, as_trained(samples), p.LossOptions(teacher_coef=beta, teacher_top_k=k), False, 2.0)
    got = torch.autograd.grad(loss, params)
    want_loss = torch.zeros(())
    want_kl = 0.0
    for s in samples:
        ids = torch.tensor([list(s.prompt_ids) + list(s.output_ids)])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(s.prompt_ids) - 1:-1]
        log_ps = torch.log_softmax(logits.float(), -1)
        lp = log_ps.gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0]
        top = torch.tensor(s.teacher_top_ids).view(-1, k)
        log_pt = torch.log_softmax(torch.tensor(s.teacher_top_logprobs).view(-1, k), -1)
        kl = (log_pt.exp() * (log_pt - log_ps.gather(-1, top))).sum(-1)
        want_kl += float(kl.detach().sum())
        want_loss = want_loss + (-s.advantage * lp + beta * kl).mean()
    want = torch.autograd.grad(want_loss, params)
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    assert sums.teacher_top_kl == pytest.approx(want_kl, rel=1e-4) and want_kl > 0
