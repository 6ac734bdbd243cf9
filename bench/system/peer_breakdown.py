"""Where a FlexMARL step of the peer job spends its time: the run's stages, and each piece alone.

Two views, both in milliseconds per step:

- `run_breakdown` (from a real run's metrics rows and event log, steady-state medians):
  rollout (first episode to last), training (the trainer's forward/backward seconds), the
  optimizer step plus weight sync (of which the sync itself, publish to loaded), and what
  is left of the step: controller work, messages and waiting between stages. In sync mode
  these are back to back and add up to the step; in async mode they overlap, and only the
  trainer's and the sync's figures are given.
- `components` (CPU time of this one-thread process, the job's model): one rollout round
  through a `VllmEngine` (adding 128 requests one by one, seeded or not, or as 8 groups
  of 16; the engine steps that follow), the weight reload (vLLM's reload and the prefix-cache reset), the
  trainer's forward/backward of 128 samples (packed, each distinct prompt once) and its
  optimizer step, and encoding plus
  decoding the round's three big messages (Generate, Generated, TrainMicroBatch); and, for
  comparison, the peer's way of generating the round (Hugging Face `generate`).

It knows the peer job's shape (peer_task), not how the stages are scheduled.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import peer_task

ROUND = 8 * 16  # requests per step: 8 prompts x 16 samples


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def run_breakdown(rows: list[dict], events: list[Any], training: Any, warmup: int) -> dict:
    """Medians over the steps after `warmup` of one run's stage times, in ms."""
    steady = [r for r in rows if r["step"] > warmup]
    syncs = [e.seconds for e in events if type(e).__name__ == "WeightSyncFinished" and e.version > warmup]
    batches = training.parts.schedule.batches
    step = [1000 * (batches[t].trained - batches[t - 1].trained) for t in range(warmup + 1, len(batches) + 1)]
    ms = {"step": _median(step),
          "rollout": 1000 * _median([r["rollout_s"] for r in steady]),
          "train (trainer fwd/bwd)": 1000 * _median([r["train_s"] for r in steady]),
          "optimizer step + weight sync": 1000 * _median([r["sync_s"] for r in steady]),
          "of which weight sync (publish to loaded)": 1000 * _median(syncs)}
    if training.parts.schedule.overlap:
        # Overlapped: a batch's rollout starts while earlier batches train and waits at the
        # gate, so first-to-last episode is no stage time, and nothing adds up to the step.
        del ms["rollout"]
    else:
        ms["rest: controller, messages, waits"] = (ms["step"] - ms["rollout"] - ms["train (trainer fwd/bwd)"]
                                                  - ms["optimizer step + weight sync"])
    lines = ["| stage | ms per step |", "|---|---|"] + [f"| {k} | {v:.1f} |" for k, v in ms.items()]
    return {"ms": {k: round(v, 2) for k, v in ms.items()}, "table": "\n".join(lines)}


def _timed(fn, reps: int) -> float:
    """Median CPU ms of `reps` calls of fn(): this process is single-threaded, and CPU time
    moves far less than wall time when other work shares the machine."""
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(1000 * (time.process_time() - t0))
    return statistics.median(times)


def components(model_dir: str, reps: int = 7) -> dict:
    """Each piece of a step alone, in ms (medians of `reps`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flexmarl.runtime import protocol
    from flexmarl.workers.rollout.engine import VllmEngine
    from flexmarl.runtime.keys import GroupKey
    from flexmarl.workers.rollout.group_requests import group_result
    from flexmarl.workers.trainer.batch import samples_of, train_group
    from flexmarl.workers.trainer.loss import policy_loss

    def split(values: list, lengths: list[int]) -> list[list]:
        ends = list(itertools.accumulate(lengths))
        return [values[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in peer_task.prompts(8, 1234)]
    engine = VllmEngine(model_dir, seed=0, max_model_len=64)
    counter = iter(range(10**9))
    ms: dict[str, float] = {}
    completions: list = []
    step_counts: list[int] = []

    def add(how: str) -> None:
        if how == "as 8 groups of 16":  # what the rollout worker does with a group's members
            for g in range(8):
                n = next(counter)
                engine.add(f"r{n}", prompts[g], peer_task.MAX_TOKENS, 1.0, 16 * n, n=16, ignore_eos=False)
            return
        for i in range(ROUND):  # one request per sample (seeded, or not to show what seeds cost)
            n = next(counter)
            engine.add(f"r{n}", prompts[i % 8], peer_task.MAX_TOKENS, 1.0, n if how == "one by one" else None,
                       ignore_eos=False)

    def drain() -> None:
        steps = 0
        while engine.has_unfinished():
            completions.extend(engine.step())
            steps += 1
        step_counts.append(steps)

    for how in ("one by one", "one by one, unseeded", "as 8 groups of 16"):
        add(how), drain()  # first-time shapes
        added = ms[f"engine: add {ROUND} requests {how}"] = _timed(
            lambda: add(how) or engine.abort(list(engine._outstanding)), reps)
        ms["engine: steps of that round"] = _timed(lambda: (add(how), drain()), reps) - added
        ms[f"engine: steps of that round ({how})"] = ms.pop("engine: steps of that round")
    ms["engine: steps per round"] = float(_median(step_counts))

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    ms["weight reload: load_weights (all)"] = _timed(lambda: engine.load_weights(weights), reps)
    ms["weight reload: of which reset_prefix_cache"] = _timed(lambda: engine._engine.reset_prefix_cache(), reps)

    done = completions[-8:]  # the last round, as 8 groups of 16
    groups = [train_group(GroupKey("bench", "solver", str(g)), prompts[g], split(c.token_ids, c.lengths),
                          [1.0 if i % 2 else -1.0 for i in range(len(c.lengths))], split(c.logprobs, c.lengths))
              for g, c in enumerate(done)]
    samples = samples_of(groups)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def fwd_bwd() -> None:
        loss, _ = policy_loss(model, samples, protocol.LossOptions(), off_policy=False, clip_ratio=2.0)
        loss.backward()

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    fwd_bwd()  # warm-up
    fb = ms[f"trainer: forward/backward of {ROUND} samples, packed"] = _timed(fwd_bwd, reps)
    ms["trainer: clip + Adam step"] = _timed(lambda: (fwd_bwd(), step()), reps) - fb

    # What the peer generates with: Hugging Face generate on the same round, left-padded.
    tokenizer.padding_side = "left"
    batch = tokenizer([p for p in peer_task.prompts(8, 1234) for _ in range(16)], return_tensors="pt",
                      padding=True, add_special_tokens=False)
    with torch.no_grad():
        ms[f"peer's generation: Hugging Face generate of the same {ROUND}"] = _timed(
            lambda: model.generate(**batch, do_sample=True, max_new_tokens=peer_task.MAX_TOKENS, top_k=0,
                                   pad_token_id=tokenizer.pad_token_id), reps)

    gen = protocol.Generate(1, [protocol.GenGroup(GroupKey("e", "solver", str(g)), "solver", ROUND // 8, prompts[g], 5,
                                                  1.0, g * ROUND // 8) for g in range(8)])
    out = protocol.Generated(1, [group_result(gen.groups[g], 0, done[g]) for g in range(8)], True)
    train = protocol.TrainMicroBatch(1, "solver", 1, groups, 0, 2.0, protocol.LossOptions())
    for name, msg in (("Generate", gen), ("Generated", out), ("TrainMicroBatch", train)):
        ms[f"message: {name} of {ROUND}, encode + decode"] = _timed(lambda: protocol.decode(protocol.encode(msg)),
                                                                    reps)
    engine.close()
    lines = ["| piece, alone | ms |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in ms.items()]
    return {"ms": {k: round(v, 3) for k, v in ms.items()}, "table": "\n".join(lines)}
