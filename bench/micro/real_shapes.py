"""Models of the shapes users train, built from their configs with random weights, and a
trainer driven in this process: what the GPU benches and the GPU check
(scripts/gpu_check.py) share.

    SHAPES                    the real shapes (and a tiny one for dry runs), keyed by name
    build_model(shape, root, device) -> the model directory, Hugging Face format
    samples(n, prompt_len, output_len, vocab, seed) -> a micro-batch's groups (of one sample each)
    Trainer                   a TrainerHandler driven through its command table
    sync(device), memcpy_gb_s(nbytes)
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from flexmarl.runtime import protocol

# Real shapes (random weights). Keys follow the models' Hugging Face configs.
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, head_dim=64,
                        tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=8192),
    # The dry run's: same code paths, seconds on a CPU.
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                       max_position_embeddings=256),
}

LR = 1e-5  # every trainer's learning rate here


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: str, root: Path, device: torch.device) -> Path:
    """A model of the shape with random weights, saved in Hugging Face format (bfloat16
    on CUDA, float32 on the CPU) under root/shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / shape
    if (path / "config.json").exists():
        return path
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, safe_serialization=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path


def samples(n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> list[protocol.TrainGroup]:
    """n samples of random ids, each a group of its own, advantages of both signs."""
    from flexmarl.runtime.keys import GroupKey
    from flexmarl.workers.trainer.batch import train_group

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(4, vocab, (prompt_len + output_len,), generator=g).tolist()
        out.append(train_group(GroupKey("bench", "a", f"s{seed}-{i}"), ids[:prompt_len], [ids[prompt_len:]],
                               [1.0 if i % 2 else -1.0], [[-1.0] * output_len]))
    return out


class Trainer:
    """A TrainerHandler driven in this process through its command table."""

    def __init__(self, handler=None):
        if handler is None:
            from flexmarl.workers.trainer.worker import TrainerHandler
            handler = TrainerHandler()
        self.handler, self.request = handler, 0

    def __call__(self, msg_type, **fields):
        self.request += 1
        reply = self.handler._execute(msg_type(request_id=self.request, **fields))
        if isinstance(reply, protocol.Error):
            raise RuntimeError(reply.message)
        return reply

    def init(self, agent: str, path: Path, settings: protocol.TrainerSettings, lr: float = None):
        lr = LR if lr is None else lr
        return self(protocol.InitAgent, agent=agent, model_path=str(path), lr=lr, seed=0, settings=settings)

    def iteration(self, agent: str, version: int, groups: list[protocol.TrainGroup]):
        """One micro-batch of `groups` and the step to `version`; the samples count as drawn
        from the version before it (on-policy)."""
        for group in groups:
            group.versions = [version - 1] * len(group.lengths)
        self(protocol.TrainMicroBatch, agent=agent, version=version, groups=groups)
        return self(protocol.OptimStep, agent=agent, version=version, samples=sum(len(g.lengths) for g in groups))

    def close(self):
        self.handler.close()


def memcpy_gb_s(nbytes: int, reps: int = 3) -> float:
    """A plain copy of nbytes between two prefaulted buffers on the CPU, best of reps."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
