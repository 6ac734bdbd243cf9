"""The coding team's tiny models: one word-level vocabulary (code_tasks.VOCAB), a coder and
a tester, each warmed up on noisy targets so RL has room to raise its reward.

Warm-up targets: the coder's program is the spec's with probability CODER_RIGHT, else a
planted-bug program for the spec; the tester's input exposes its bug with probability
TESTER_RIGHT, else it is a random digit. The warm-up covers every spec, held-out ones
included (what the models know before RL); RL trains on data/train.jsonl only. Built on
first use and cached like every tiny model:

    python -m flexmarl.workers.models --job examples/code_team/models.py --agent coder --cache-root .cache/models
"""

from __future__ import annotations

import functools
import random

from code_tasks import EOS_ID, VOCAB, all_specs, coder_prompt, exposing_inputs, ids, plant_bug, program, tester_prompt

from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec, WarmupSchedule

CODER_RIGHT = 0.3
TESTER_RIGHT = 0.3
WARMUP_EXAMPLES = 6000
SCHEDULE = WarmupSchedule(steps=500, batch_size=64, lr=3e-3)
WARMUP_VERSION = "code-team-2"

SPECS = {
    "coder": TinyModelSpec("code_coder", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                           intermediate_size=128, seed=11),
    "tester": TinyModelSpec("code_tester", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                            intermediate_size=128, seed=12),
}


def coder_examples(n: int = WARMUP_EXAMPLES) -> list[tuple[list[int], list[int]]]:
    rng = random.Random("warmup-coder")
    specs = all_specs()
    out = []
    for _ in range(n):
        op, d = rng.choice(specs)
        target = program(op, d) if rng.random() < CODER_RIGHT else plant_bug(op, d, rng)
        out.append((ids(coder_prompt(op, d)), ids(target) + [EOS_ID]))
    return out


def tester_examples(n: int = WARMUP_EXAMPLES) -> list[tuple[list[int], list[int]]]:
    rng = random.Random("warmup-tester")
    specs = all_specs()
    out = []
    for _ in range(n):
        op, d = rng.choice(specs)
        planted = plant_bug(op, d, rng)
        x = rng.choice(exposing_inputs(op, d, planted)) if rng.random() < TESTER_RIGHT else rng.randrange(10)
        out.append((ids(tester_prompt(op, d, planted)), ids(str(x)) + [EOS_ID]))
    return out


TINY_MODELS = {
    "coder": TinyModelRecipe(SPECS["coder"], VOCAB, functools.partial(coder_examples), WARMUP_VERSION, SCHEDULE),
    "tester": TinyModelRecipe(SPECS["tester"], VOCAB, functools.partial(tester_examples), WARMUP_VERSION, SCHEDULE),
}
