"""Weight sync into a real vLLM engine for the common layouts: Llama and Qwen2, with tied and
untied input/output embeddings, pushed the way a trainer publishes them."""

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from flexmarl.controller.tasks import digit_chain as tasks  # noqa: E402
from flexmarl.workers import models  # noqa: E402
from flexmarl.workers.rollout.engine import TIED_EMBEDDING, TIED_HEAD, without_tied_head  # noqa: E402

MAX_TOKENS = 6
SHAPE = dict(vocab_size=len(tasks.VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5,
             bos_token_id=tasks.BOS_ID, eos_token_id=tasks.EOS_ID, pad_token_id=tasks.PAD_ID)


def config(arch: str, tied: bool):
    from transformers import LlamaConfig, Qwen2Config

    build = {"llama": lambda: LlamaConfig(**SHAPE, head_dim=32, tie_word_embeddings=tied),
             "qwen2": lambda: Qwen2Config(**SHAPE, use_sliding_window=False, tie_word_embeddings=tied)}
    return build[arch]()


def build(arch: str, tied: bool, out) -> None:
    """A tiny model saved as transformers saves it (a tied head is left out of the file),
    warmed up so greedy choices are not near-ties that float rounding could flip."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(arch, tied), dtype=torch.float32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    examples = tasks.warmup_examples(tasks.SOLVER, random.Random(0), 1024)
    models.warm_up(model, examples, models.WarmupSchedule(steps=80, batch_size=32, lr=3e-3), 0, tasks.PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    models.build_tokenizer(tasks.VOCAB).save_pretrained(out)


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(2)
    return [tasks.solver_prompt(tasks.make_query(rng)) for _ in range(n)]


def engine_greedy(engine, batch) -> list[list[int]]:
    for i, prompt in enumerate(batch):
        engine.add(f"g{i}", prompt, MAX_TOKENS, 0.0, 0)
    done = {}
    while engine.has_unfinished():
        done.update((c.request_id, c.token_ids) for c in engine.step())
    return [done[f"g{i}"] for i in range(len(batch))]


def reference_greedy(model, batch) -> list[list[int]]:
    outs = []
    for prompt in batch:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def perturb(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():  # a tied matrix is one parameter: changed once
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)


# What a trainer may publish: `state_dict()` (a tied head appears under both names, sharing
# storage) or `named_parameters()` (each parameter once).
PUBLISHED = {
    "state_dict": lambda model: [(n, t.detach()) for n, t in model.state_dict().items()],
    "named_parameters": lambda model: [(n, t.detach()) for n, t in model.named_parameters()],
    # After a transfer the alias is a separate copy with equal values.
    "copied_state_dict": lambda model: [(n, t.detach().clone()) for n, t in model.state_dict().items()],
}


@pytest.mark.slow
@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)])
def test_pushed_weights_give_the_same_greedy_tokens_as_transformers(tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM

    from flexmarl.workers.rollout.engine import VllmEngine

    torch.set_num_threads(1)
    build(arch, tied, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    batch = prompts(12)
    engine = VllmEngine(tmp_path, seed=0, max_model_len=64)
    try:
        assert engine.tied_embeddings == tied
        assert engine_greedy(engine, batch) == reference_greedy(reference, batch)
        seen = []
        for seed, form in enumerate(PUBLISHED, start=1):
            perturb(reference, seed)
            engine.load_weights(PUBLISHED[form](reference))
            tokens = engine_greedy(engine, batch)
            assert tokens == reference_greedy(reference, batch), form
            seen.append(tokens)
        assert seen[0] != seen[1] != seen[2]  # each push changed what the engine samples
    finally:
        engine.close()


def test_a_tied_head_is_dropped_when_it_equals_the_embedding_and_refused_when_it_differs():
    embedding = torch.randn(18, 8)
    others = [("model.norm.weight", torch.ones(8))]
    shared = [(TIED_EMBEDDING, embedding), (TIED_HEAD, embedding), *others]
    assert [n for n, _ in without_tied_head(shared)] == [TIED_EMBEDDING, "model.norm.weight"]
    copied = [(TIED_EMBEDDING, embedding), (TIED_HEAD, embedding.clone()), *others]
    assert [n for n, _ in without_tied_head(copied)] == [TIED_EMBEDDING, "model.norm.weight"]
    assert without_tied_head([(TIED_EMBEDDING, embedding), *others]) == [(TIED_EMBEDDING, embedding), *others]
    with pytest.raises(ValueError, match="differ"):
        without_tied_head([(TIED_EMBEDDING, embedding), (TIED_HEAD, embedding + 1), *others])


@pytest.mark.slow
@pytest.mark.parametrize("arch, tied", [("llama", True), ("qwen2", False)])
def test_the_in_place_reload_gives_exactly_what_vllms_reload_gives(tmp_path, arch, tied):
    """A CPU engine reloads by copying into its model and repacking (engine_reload.py);
    an engine that reloads through vLLM's own machinery must sample the same tokens with
    the same logprobs after every push. Qwen2 has biases in its fused q/k/v layer."""
    from transformers import AutoModelForCausalLM

    from flexmarl.workers.rollout.engine import VllmEngine

    torch.set_num_threads(1)
    build(arch, tied, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    batch = prompts(12)
    fast, slow = VllmEngine(tmp_path, seed=0), VllmEngine(tmp_path, seed=0, inplace_reload=False)

    def sampled(engine, tag):
        for i, prompt in enumerate(batch):
            engine.add(f"{tag}{i}", prompt, MAX_TOKENS, 1.0, 100 + i)
        done = {}
        while engine.has_unfinished():
            done.update((c.request_id, c) for c in engine.step())
        return [done[f"{tag}{i}"] for i in range(len(batch))]

    try:
        before = sampled(fast, "b")
        for seed in (1, 2):
            perturb(reference, seed)
            for engine in (fast, slow):
                engine.load_weights(PUBLISHED["named_parameters"](reference))
            assert (fast.last_reload, slow.last_reload) == ("in place", "vllm")
            mine, theirs = sampled(fast, f"f{seed}-"), sampled(slow, f"s{seed}-")
            assert [c.token_ids for c in mine] == [c.token_ids for c in theirs]
            torch.testing.assert_close(torch.tensor([c.logprobs for c in mine]),
                                       torch.tensor([c.logprobs for c in theirs]), atol=1e-6, rtol=0)
        assert [c.logprobs for c in mine] != [c.logprobs for c in before]  # the pushes changed the model
    finally:
        fast.close()
        slow.close()


def test_the_in_place_plan_fills_fused_layers_in_order_and_refuses_what_it_cannot_place():
    from flexmarl.workers.rollout.engine_reload import NotPlannable, Plan

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = torch.nn.Linear(4, 12)
            self.o_proj = torch.nn.Linear(4, 4, bias=False)

    class Model(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])

    names = ["layers.0.v_proj.weight", "layers.0.q_proj.weight", "layers.0.k_proj.weight",
             "layers.0.o_proj.weight"]
    plan = Plan.build(Model(), names)
    parts = {(t.module_name, p): n for t in plan.targets for p, n in t.parts.items()}
    assert parts == {("layers.0.qkv_proj", "weight"): ["layers.0.q_proj.weight", "layers.0.k_proj.weight",
                                                       "layers.0.v_proj.weight"],
                     ("layers.0.o_proj", "weight"): ["layers.0.o_proj.weight"]}
    with pytest.raises(NotPlannable, match="incomplete"):
        Plan.build(Model(), ["layers.0.q_proj.weight", "layers.0.v_proj.weight"])
    with pytest.raises(NotPlannable, match="no module"):
        Plan.build(Model(), ["layers.0.mlp.down_proj.weight"])


def test_a_reloaded_layer_whose_kernel_packs_nothing_keeps_no_view_of_the_received_weights():
    """Where the matmul kernel cannot pack a dtype (bfloat16 without AVX-512 here), vLLM
    falls back to a plain matmul over the weight as given: the engine must then hold a copy,
    because the received tensors are views of the publisher's memory, which its next
    version overwrites."""
    from flexmarl.workers.rollout.engine_reload import InPlaceReload

    class UnquantizedLinearMethod:  # vLLM's, where its kernel falls back: the weight stays as given
        def process_weights_after_loading(self, layer):
            pass

    class Packable(torch.nn.Module):  # a linear layer after its first load: the matrix packed away
        def __init__(self, out, inp):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            self.output_size_per_partition, self.input_size_per_partition = out, inp
            self.quant_method = UnquantizedLinearMethod()

    class Model(torch.nn.Module):
        packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

        def __init__(self):
            super().__init__()
            self.gate_up_proj, self.down_proj = Packable(8, 4), Packable(4, 4)

    published = {"gate_proj.weight": torch.randn(4, 4), "up_proj.weight": torch.randn(4, 4),
                 "down_proj.weight": torch.randn(4, 4)}
    want = {k: v.clone() for k, v in published.items()}
    model, reload = Model(), InPlaceReload()
    for _ in range(2):  # a second reload reuses the staging buffer of the first
        assert reload(model, published)
        for t in published.values():  # the publisher writes its next version into the same memory
            t.add_(1.0)
        assert torch.equal(model.down_proj.weight, want["down_proj.weight"])
        assert torch.equal(model.gate_up_proj.weight, torch.cat([want["gate_proj.weight"], want["up_proj.weight"]]))
        for k in want:
            want[k] += 1.0
