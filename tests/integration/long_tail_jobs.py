"""What the in-flight and continuous-admission run tests share: the long-tail bench's job
(bench/system/long_tail.py: a randomly initialised writer whose outputs run long, so syncs
land while groups are running), under in_flight "keep" at K = 1, written for a test."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "system"))
import long_tail  # noqa: E402


def write_job(folder, *, steps, seed, max_tokens, admission="step", adapter=False, partial_rollout=0, queries=4):
    """The job (`queries` queries a step, groups of 4; `admission` and `partial_rollout` as
    long_tail.job takes them), written as folder/job.toml; its path."""
    args = argparse.Namespace(steps=steps, seed=seed, chain=False, adapter=adapter, queries=queries, group_size=4,
                              max_tokens=max_tokens, partial_rollout=partial_rollout)
    path = folder / "job.toml"
    path.write_text(long_tail.job(args, "keep", 1, admission))
    return path
