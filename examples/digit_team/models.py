"""The digit team's base model: a tiny Llama every agent adapts (about 2.4M parameters, so
a rank-8 adapter on q/k/v/o is about 2% of it), warmed up on all five tasks with noisy
targets. Built on first use, cached like the built-in models."""

from __future__ import annotations

import functools
import random

from tasks import warmup_examples

from flexmarl.controller.tasks.digit_chain import VOCAB
from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec, WarmupSchedule

BASE = TinyModelSpec("team_base", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                     intermediate_size=512, seed=7)


def _warmup(n: int = 8192) -> list:
    return warmup_examples(random.Random("warmup-team-base"), n, correct_prob=0.45)


TINY_MODELS = {
    "base": TinyModelRecipe(BASE, VOCAB, functools.partial(_warmup), "digit-team-1",
                            WarmupSchedule(steps=400, batch_size=64, lr=2e-3)),
}
