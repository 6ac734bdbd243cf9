"""What `flexmarl replay LOG` spends its time on: the whole command, and its parts.

    python bench/micro/replay_parts.py RUN/events.log [--check] [--repeats N]

Per repeat, one JSON row: the wall seconds of the command itself (`python -m
flexmarl.controller.cli replay [--check] LOG`, interpreter start and imports included,
its output discarded), then, in a fresh process, the seconds of importing replay and of
each step its `main` takes, timed inside `main` as it runs them (with its own collector
settings): `read_events`, `summarize`, `format_summary` and, with --check, `check`. The
parts run one after the other (the check in the same process, after the summary, not in
a child beside it as the command runs it where there is a second core): they add up to
the command on one core.

It imports FlexMARL from wherever Python finds it: run it once with the code before a
change on PYTHONPATH and once without, alternating, to compare the two.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable


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
    from flexmarl.controller.replay import checking, command
    spent = {"import_s": time.perf_counter() - t0}

    def timed(name: str, step: Callable) -> Callable:
        def run(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return step(*args)
            finally:
                spent[f"{name}_s"] = time.perf_counter() - t
        return run

    for name, step in (("read", command.read_events), ("summarize", command.summarize),
                       ("format", command.format_summary)):
        setattr(command, step.__name__, timed(name, step))  # main calls them by these module names
    timed_check = timed("check", checking.check)
    command.check_beside = lambda events: lambda: timed_check(events)  # here, when asked: timed on its own
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        command.main(argparse.Namespace(log=log, check=check, trace=None, plot=None))
    return spent


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
