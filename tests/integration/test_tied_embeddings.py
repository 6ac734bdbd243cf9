"""A run whose agents are Hugging Face models with tied input and output embeddings
(as Qwen2.5 0.5B-3B and Llama 3.2 1B/3B ship), saved by transformers the usual way (no
lm_head.weight in the file): weight syncs, parking and restoring on a shared trainer, and
the final checkpoint all work."""

import asyncio
import json

import pytest
import torch

from flexmarl.controller import Experiment
from flexmarl.controller.tasks import digit_chain as chain
from flexmarl.runtime.config import load_config
from flexmarl.workers import models

pytestmark = pytest.mark.slow

SHAPE = dict(vocab_size=len(chain.VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5,
             bos_token_id=chain.BOS_ID, eos_token_id=chain.EOS_ID, pad_token_id=chain.PAD_ID,
             tie_word_embeddings=True)


def save_tied(arch: str, out) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = {"qwen2": lambda: Qwen2Config(**SHAPE, use_sliding_window=False),
              "llama": lambda: LlamaConfig(**SHAPE, head_dim=32)}[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out, safe_serialization=True)
    models.build_tokenizer(chain.VOCAB).save_pretrained(out)
    return str(out)


def test_agents_with_tied_embeddings_train_sync_park_and_checkpoint(tmp_path):
    solver, checker = save_tied("qwen2", tmp_path / "qwen2"), save_tied("llama", tmp_path / "llama")
    cfg = load_config(None, ["run.steps=2", "pipeline.queries_per_step=2", "run.progress=false",
                             "pipeline.mode='sync'", f"agents.solver.model='{solver}'",
                             f"agents.checker.model='{checker}'", "cluster.trainer_capacity=1"],
                      defaults=chain.default_config())

    async def main():
        async with Experiment(cfg, run_dir=tmp_path / "run") as exp:
            summary = await exp.train()
            return summary, exp.training.parts.allocator.swaps

    summary, swaps = asyncio.run(main())
    assert swaps >= 2, "with one trainer slot the agents are parked and restored"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["agent"], r["version"]) for r in rows if r["agent"] in ("solver", "checker")) == [
        ("checker", 1), ("checker", 2), ("solver", 1), ("solver", 2)]
    from transformers import AutoModelForCausalLM

    for agent, source in (("solver", solver), ("checker", checker)):
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "final" / agent)
        initial = AutoModelForCausalLM.from_pretrained(source)
        assert trained.lm_head.weight is trained.model.embed_tokens.weight
        assert not torch.equal(trained.model.embed_tokens.weight, initial.model.embed_tokens.weight)
