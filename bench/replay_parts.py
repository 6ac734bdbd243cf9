"""What `flexmarl replay LOG` spends its time on: the whole command, and its parts.

    python bench/replay_parts.py RUN/events.log [--check] [--repeats N]

Per repeat, one JSON row: the wall seconds of the command itself (`python -m
flexmarl.controller.cli replay [--check] LOG`, interpreter start and imports included,
its output discarded), then the same steps in this process, in the command's order:
`read_events`, `summarize`, `format_summary` and, with --check, `check`. Each step runs
as the command runs it (its own collector settings), so the parts add up to about the
command less its start.

It imports FlexMARL from wherever Python finds it: run it once with the code before a
change on PYTHONPATH and once without, alternating, to compare the two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def command_s(log: str, check: bool) -> float:
    args = [sys.executable, "-m", "flexmarl.controller.cli", "replay", *(["--check"] if check else []), log]
    t = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - t
    if done.returncode not in (0, 1) or "Traceback" in done.stderr:  # 1: the log's accounting or check failed
        raise SystemExit(f"replay exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds


def parts_s(log: str, check: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    from flexmarl.controller.records import replay
    from flexmarl.runtime.eventlog import read_events
    t1 = time.perf_counter()
    events, _ = read_events(log)
    t2 = time.perf_counter()
    summary = replay.summarize(events)
    t3 = time.perf_counter()
    replay.format_summary(summary)
    t4 = time.perf_counter()
    out = {"import_s": t1 - t0, "read_s": t2 - t1, "summarize_s": t3 - t2, "format_s": t4 - t3}
    if check:
        replay.check(events)
        out["check_s"] = time.perf_counter() - t4
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    p.add_argument("--check", action="store_true", help="time `replay --check` (the re-drive too)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--parts-only", action="store_true", help=argparse.SUPPRESS)  # one process's parts, as JSON
    args = p.parse_args()
    check = ["--check"] if args.check else []
    if args.parts_only:
        print(json.dumps(parts_s(args.log, args.check)))
        return
    for repeat in range(args.repeats):
        row = {"log": os.path.basename(args.log), "check": args.check, "repeat": repeat,
               "command_s": command_s(args.log, args.check)}
        # The parts in a fresh process, as the command meets them (nothing imported or read yet).
        done = subprocess.run([sys.executable, __file__, args.log, "--parts-only", *check], capture_output=True,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            raise SystemExit(f"the parts run failed: {done.stderr[-2000:]}")
        row.update(json.loads(done.stdout))
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
