"""A trainer group of N ranks (FSDP2) against one trainer process, on the same job.

    python bench/micro/trainer_group.py [--ranks 2] [--steps 6] [--micro-batches 4] [--samples 16]
                                  [--hidden 256] [--layers 4]

One model (a tiny Qwen2-style model built here, digit-chain vocabulary), one job: `steps`
optimizer steps, each over `micro-batches` micro-batches of `samples` samples (prompt and
output ids from the digit chain, random advantages), the same samples for both. For one
process (TrainerHandler) and for a group of `ranks` (TrainerGroupHandler: rank 0 here, the
others started by it), it times each step from the first micro-batch sent to the step's
reply, and one publish of the full weights (a group gathers them first). The first step is
warm-up and left out of the median. It also prints the largest weight difference between
the two after the job: the group must make the same update.

On CPU the ranks talk over gloo; on a machine with N GPUs they run NCCL on one GPU each.
Prints one JSON line per configuration and one with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from flexmarl.controller.tasks import digit_chain  # noqa: E402
from flexmarl.runtime import protocol as p  # noqa: E402
from flexmarl.runtime.model_specs import TinyModelSpec  # noqa: E402
from flexmarl.runtime.params.channel import ParamChannel  # noqa: E402
from flexmarl.workers import models  # noqa: E402
from flexmarl.runtime.keys import GroupKey  # noqa: E402
from flexmarl.workers.trainer.batch import train_group  # noqa: E402
from flexmarl.workers.trainer.group import TrainerGroupHandler  # noqa: E402
from flexmarl.workers.trainer.worker import TrainerHandler  # noqa: E402


def job(steps: int, micro_batches: int, samples: int) -> list[list[list[p.TrainGroup]]]:
    """Per step, per micro-batch: `samples` groups of one sample each (its own prompt)."""
    rng = random.Random(0)

    def sample(i: int, version: int) -> p.TrainGroup:
        query = digit_chain.make_query(rng)
        output = digit_chain.make_query(rng) + digit_chain.make_query(rng)
        return train_group(GroupKey("bench", "agent", str(i)), digit_chain.solver_prompt(query), [output],
                           [rng.uniform(-1, 1)], versions=[version - 1])

    return [[[sample(m * samples + i, v) for i in range(samples)] for m in range(micro_batches)]
            for v in range(1, steps + 1)]


def run(handler, model_dir: Path, batches) -> dict:
    handler._execute(p.InitAgent(1, "agent", str(model_dir), 1e-3, 0))
    step_s = []
    for version, micro in enumerate(batches, start=1):
        t0 = time.perf_counter()
        for mb in micro:
            handler._execute(p.TrainMicroBatch(2, "agent", version, mb))
        handler._execute(p.OptimStep(3, "agent", version, samples=sum(len(mb) for mb in micro)))
        step_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = handler._execute(p.PublishWeights(4, "agent", len(batches), "shm"))
    publish_s = time.perf_counter() - t0
    with ParamChannel() as channel:
        weights = {k: v.clone() for k, v in channel.receive(out.handle).items()}
    return {"step_s_median": statistics.median(step_s[1:]), "step_s": [round(s, 3) for s in step_s],
            "publish_s": publish_s, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = TinyModelSpec("bench-group", hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                         num_kv_heads=2, intermediate_size=4 * args.hidden, seed=5)
    batches = job(args.steps, args.micro_batches, args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = models.build_model(spec, digit_chain.VOCAB, Path(tmp) / "model")
        n_params = sum(t.numel() for t in load_file(next(Path(model_dir).glob("*.safetensors"))).values())
        results = {}
        for ranks in (1, args.ranks):
            handler = TrainerHandler() if ranks == 1 else TrainerGroupHandler.start(ranks)
            try:
                results[ranks] = run(handler, model_dir, batches)
            finally:
                handler.close()
    device = "cuda" if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores, gloo)"
    for ranks, r in results.items():
        print(json.dumps({"ranks": ranks, "device": device, "params": n_params,
                          "samples_per_step": args.micro_batches * args.samples,
                          "step_s_median": round(r["step_s_median"], 4), "steps_s": r["step_s"],
                          "publish_s": round(r["publish_s"], 4)}))
    one, group = results[1], results[args.ranks]
    diff = max((one["weights"][k] - group["weights"][k]).abs().max().item() for k in one["weights"])
    print(json.dumps({"group_over_one_step_time": round(group["step_s_median"] / one["step_s_median"], 3),
                      "max_weight_diff": diff}))


if __name__ == "__main__":
    main()
