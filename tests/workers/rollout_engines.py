"""What the rollout engine's tests share: running an engine's requests to their end and
scoring an output under a model; for the adapter tests, a small randomly initialised Qwen2
base (written once per module by the `base_dir` fixture of tests/workers/rollout/conftest.py)
and random LoRA adapters of it."""

import torch

from flexmarl.runtime import protocol as p

LORA = p.LoraSettings(rank=8, alpha=16.0)
VOCAB = 64


def drain(engine) -> dict:
    """Steps `engine` until nothing is left unfinished: its completions by request id."""
    done = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    return done


def logprobs_under(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Each output token's logprob under `model` (a transformers model), given all before it."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def write_base(out):
    """The base, saved in `out` (seed 0); returns `out`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         use_sliding_window=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def adapter(base_dir, seed):
    """A random adapter (B not zero, so it changes the model): the PEFT model and its
    tensors under PEFT's file names."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from flexmarl.workers.adapters import lora_config

    torch.manual_seed(seed)
    config = lora_config(LORA, str(base_dir))
    config.init_lora_weights = False
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), config).eval()
    return model, {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
