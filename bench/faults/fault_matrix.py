"""Faults injected into real runs, one run each, at a random moment: the table of what
became of each run (finished, samples lost or trained twice, the last line the user saw).

Every run is a real `flexmarl run` of one small job (a tiny model, one rollout worker,
one trainer, async K = 1, a checkpoint every step): controller and workers as processes,
vLLM and torch. Each fault is injected at a random moment of training (seeded): during a
random step, a random fraction of a second into it, the step and the seconds printed:

    stall-controller  SIGSTOP the controller for 20 s (four heartbeat timeouts), then SIGCONT:
                      every worker leaves and is restarted (the job in sync mode, each
                      episode waiting 1.5 s first: the pipeline waits for samples)
    zero-log          SIGKILL the controller, zero 64 bytes halfway through events.log
                      (intact frames after them), then `--resume`
    halve-log         SIGKILL the controller, cut events.log to half its size, then `--resume`
    damage-state      flip a byte in the newest checkpoint's training state, then SIGKILL
                      the trainer (its agent is restored from a checkpoint during the run)
    large-request     a text completion of 6 MiB (under the 8 MiB body cap) posted to the
                      run's endpoint with a live episode's key (the job with openai.enabled)
    kill-rollout      SIGKILL the rollout worker
    stop-rollout      SIGSTOP the rollout worker, never continued (hung: heartbeats stop)
    kill-trainer      SIGKILL the trainer
    kill-controller   SIGKILL the controller, then `flexmarl run --resume`
    flip-weights      SIGKILL the controller, flip a byte in the newest checkpoint's
                      model.safetensors, then `--resume`
    cut-state         SIGKILL the controller, truncate the newest checkpoint's training
                      state, then `--resume`
    ctrl-c            SIGINT the controller (Ctrl-C), then `--resume`
    disk-full         the run directory on a 64 MiB tmpfs mounted here (root), filled up;
                      then the filler removed and `--resume`
    workflow-error    the workflow raises in every episode from a random step on
    missing-field     the data lacks the field the workflow reads

What is measured per fault, from the run's event log (through `flexmarl replay`'s code)
and the controller's stderr: whether the run reached its last step (after the resume
where there is one), samples lost (generated but neither trained, dropped nor in flight)
and trained twice, `replay --check`, the tracebacks printed (Python's, "never retrieved",
InvalidStateError: none expected) and the last line of stderr. A resumed run whose log was
damaged counts without the batches the damage split (replay names them); the large
request's row says how it was answered.

    sudo .venv/bin/python bench/faults/fault_matrix.py [--faults a,b] [--seed S] [--out DIR]

The job, the injections and the outcome live in flexmarl.controller.testing.faults, shared
with tests/integration/test_faults.py, whose first case is this bench's smoke run (one
fault, two steps).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from flexmarl.controller.testing.faults import INJECT, Outcome, run_with, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=",".join(INJECT), help="comma-separated, from: " + ", ".join(INJECT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("runs/fault_matrix"))
    args = ap.parse_args()
    faults = args.faults.split(",")
    unknown = [f for f in faults if f not in INJECT]
    if unknown:
        sys.exit(f"unknown faults {unknown} (known: {', '.join(INJECT)})")
    rng = random.Random(args.seed)
    outcomes = []
    for fault in faults:
        t0 = time.monotonic()
        try:
            outcome = run_with(fault, args.out.resolve() / fault, rng, args.steps)
        except (RuntimeError, TimeoutError) as exc:  # the bench could not inject it: said, and on to the next
            outcome = Outcome(fault, last_line=f"NOT MEASURED: {exc}"[:160])
        outcomes.append(outcome)
        print(f"{fault}: {outcome.row()} ({time.monotonic() - t0:.0f}s)", flush=True)
    print(f"\nseed {args.seed}, {args.steps} steps per run\n")
    print(table(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
