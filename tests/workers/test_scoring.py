"""Output logits with each distinct prompt computed once, against a plain pass over prompt + output."""

from types import SimpleNamespace

import pytest
import torch

from flexmarl.runtime import protocol as p
from flexmarl.workers import scoring


def tiny_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=17, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=32)
    config, cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[kind]
    return cls(config(**shape)).float()


def groups():
    """Two groups of 3 samples on prompts of different lengths, outputs of 1-4 tokens, and
    one sample alone on a third prompt."""
    rows = [([1, 5, 6], [[7, 8], [9], [7, 7, 7, 2]]), ([1, 4, 9, 9, 3], [[2, 2, 2], [5, 6], [3]]), ([1, 12], [[4]])]
    return [p.TrainSample(f"s{i}-{j}", prompt, out, 1.0, [], [0]) for i, (prompt, outs) in enumerate(rows)
            for j, out in enumerate(outs)]


def output_logprobs(logits, out_ids):
    return torch.log_softmax(logits, -1).gather(-1, out_ids[..., None]).squeeze(-1)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_shared_prompts_give_the_logits_and_gradients_of_a_full_pass(kind):
    model, samples = tiny_model(kind), groups()
    _, out_ids, valid = scoring.output_logits(model, samples)
    results = []
    for strategy in (scoring._full_pass, scoring._shared_prefix):
        model.zero_grad()
        logp = output_logprobs(strategy(model, samples, out_ids, valid), out_ids)
        (logp * valid).sum().backward()
        results.append((logp.detach() * valid, {k: v.grad.clone() for k, v in model.named_parameters()}))
    (full, full_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, full, rtol=1e-5, atol=1e-5)
    for name, grad in full_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_each_distinct_prompt_runs_once_and_outputs_once_per_sample():
    model, samples = tiny_model("qwen2"), groups()
    shapes = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    scoring.output_logits(model, samples)
    assert shapes == [(3, 5), (7, 4)]  # 3 distinct prompts (longest 5), then 7 outputs (longest 4)


def test_a_model_that_takes_no_cache_gets_the_full_pass():
    calls = []

    class Table(torch.nn.Module):  # called like a causal LM, but without past_key_values
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(17, 17))

        def forward(self, input_ids, attention_mask):
            calls.append(tuple(input_ids.shape))
            return SimpleNamespace(logits=self.table[input_ids])

    model, samples = Table(), groups()
    logits, out_ids, valid = scoring.output_logits(model, samples)
    assert calls == [(7, 8)]  # one pass over prompt + output, the longest 5 + 3
    # Output token j of a sample is predicted from the token before it.
    # samples[5]: prompt [1, 4, 9, 9, 3], output [3]
    torch.testing.assert_close(logits[5, 0], model.table[3])
    assert valid[5].tolist() == [True, False, False, False]


def test_a_sample_with_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        scoring.output_logits(tiny_model("qwen2"), [p.TrainSample("s", [], [3], 1.0, [], [0])])
