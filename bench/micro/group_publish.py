"""What rank 0 of a trainer group holds while it publishes an agent's weights.

    python bench/micro/group_publish.py [--shape qwen2.5-0.5b] [--ranks 2] [--reps 2]

A model of a real shape (random weights, built from its config, float32 master weights,
bfloat16 served: mixed precision) is sharded over a group of `ranks` (FSDP2; gloo on the
CPU, NCCL on GPUs). Rank 0 publishes it over shm, two ways, `reps` times each:

- whole:    every weight gathered first, then the set packed into the bucket (the group's
            order before weights were streamed into the bucket; the shards are cast to
            bfloat16 before the gather both ways);
- streamed: each weight gathered when the packing reaches it, and let go once copied.

For each: the most bytes of gathered weights rank 0 held at once (counted exactly, each
gathered tensor followed until freed), and its peak resident memory during the publish
above what it held before (the bucket, in shared memory, counts: its pages are rank 0's;
this one moves with what the allocator kept from earlier publishes), against the
bucket's bytes and the largest single weight's. On a GPU the same figures are
the CUDA allocator's peak. Prints one JSON line per publish and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import weakref
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_shapes import SHAPES, build_model  # noqa: E402

from flexmarl.runtime import protocol as p  # noqa: E402
from flexmarl.runtime.params.types import ParamChannelConfig  # noqa: E402
from flexmarl.workers.trainer.group import TrainerGroupHandler  # noqa: E402

MB = 1 << 20


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak(device: torch.device) -> int:
    """Start a peak measurement; returns the bytes held now."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    Path("/proc/self/clear_refs").write_text("5")  # the kernel resets VmHWM to the current RSS
    return _status_kb("VmRSS") * 1024


def peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _status_kb("VmHWM") * 1024


class GatherCount:
    """The bytes of gathered weights alive at once on this rank (DTensor.full_tensor's
    results, followed until freed): exact, where resident memory moves with the allocator."""

    def __init__(self):
        from torch.distributed.tensor import DTensor

        self.live = self.most = 0
        full_tensor = DTensor.full_tensor

        def counted(tensor, *args, **kwargs):
            full = full_tensor(tensor, *args, **kwargs)
            nbytes = full.numel() * full.element_size()
            self.live += nbytes
            self.most = max(self.most, self.live)
            weakref.finalize(full, self._gone, nbytes)
            return full

        DTensor.full_tensor = counted

    def _gone(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset(self) -> None:
        self.most = self.live


def gathered_whole(state, dtype) -> dict[str, torch.Tensor]:
    """The whole set gathered, then packed: the group's order before it streamed (each
    shard is cast before its gather here, as the group does now)."""
    return {k: v.detach().to(dtype).full_tensor() for k, v in state.model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--models", default="", help="where to build the model (default: a temporary directory)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="flexmarl-group-publish-") as scratch:
        t0 = time.perf_counter()
        path = build_model(args.shape, Path(args.models or scratch), torch.device("cpu"))
        print(f"built {args.shape} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        # No spare segments: each publish then faults in a bucket of its own, so every
        # publish's peak counts its bucket (a reused spare would be resident already).
        handler = TrainerGroupHandler.start(args.ranks, channel_config=ParamChannelConfig(spare_buffers=0))
        try:
            settings = p.TrainerSettings(dtype="bfloat16", precision="mixed")
            handler._execute(p.InitAgent(1, "agent", str(path), 1e-5, 0, settings=settings))
            params = dict(handler.agents["agent"].model.named_parameters())
            largest = max(v.numel() for v in params.values()) * torch.bfloat16.itemsize
            streamed_full_weights = handler._full_weights
            rows = []
            gathers = GatherCount()
            for rep in range(args.reps):
                for way in ("whole", "streamed"):
                    handler._full_weights = gathered_whole if way == "whole" else streamed_full_weights
                    gathers.reset()
                    before = reset_peak(device)
                    t0 = time.perf_counter()
                    out = handler._execute(p.PublishWeights(2, "agent", 0, "shm"))
                    seconds = time.perf_counter() - t0
                    extra = peak(device) - before
                    row = {"way": way, "rep": rep, "shape": args.shape, "ranks": args.ranks, "device": str(device),
                           "publish_s": round(seconds, 3), "gathered_held_mb": round(gathers.most / MB, 1),
                           "gathered_held_bytes": gathers.most, "largest_weight_bytes": largest,
                           "peak_extra_mb": round(extra / MB, 1),
                           "bucket_mb": round(out.handle.total_bytes / MB, 1), "largest_weight_mb": round(largest / MB, 1),
                           "extra_over_bucket_mb": round((extra - out.handle.total_bytes) / MB, 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            handler.close()
    held = {way: max(r["gathered_held_mb"] for r in rows if r["way"] == way) for way in ("whole", "streamed")}
    best = {way: min(r["extra_over_bucket_mb"] for r in rows if r["way"] == way) for way in ("whole", "streamed")}
    print(json.dumps({"summary": True, "shape": args.shape, "ranks": args.ranks,
                      "gathered_held_mb_whole": held["whole"], "gathered_held_mb_streamed": held["streamed"],
                      "extra_over_bucket_mb_whole": best["whole"], "extra_over_bucket_mb_streamed": best["streamed"],
                      "bucket_mb": rows[0]["bucket_mb"], "largest_weight_mb": rows[0]["largest_weight_mb"]}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
