"""Each agent's cycle in a run, from its event log: rollout, training, weight sync per version.

For every version v an agent is trained into, in milliseconds from the log's first event:
- rollout: the first dispatch to the last reply of the requests whose samples train into v;
- train: the start of its first micro-batch (its end minus its trainer-side seconds) to the
  end of its last;
- sync: when the weight sync of v finished (rollout instances hold v from then on).

Then, per agent, the median time from one sync to the next (the agent's iteration) and the
median of each stage of it: waiting for the trainer after the rollout, training, and from
the last micro-batch to the end of the sync (the step, the publish and the reload, and any
micro-batch of another agent running on the trainer when they arrive). At async K = 0 an
agent's next rollout waits for its sync, so these stages are its iteration's serial path.
Last, the trainer-side seconds of one micro-batch, per agent and size (median).

    .venv/bin/python bench/system/agent_cycles.py RUN_DIR [--skip 2]
"""

from __future__ import annotations

import argparse
import collections
import statistics

from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events


def cycles(events: list) -> dict[tuple[str, int], dict[str, float]]:
    """(agent, version) -> {"disp", "done", "mb1", "mbN", "sync"} in ms from the first event."""
    t0 = events[0].t
    marks: dict[tuple[str, int], dict[str, float]] = collections.defaultdict(dict)
    dispatched: dict[int, float] = {}
    for e in events:
        t = 1000 * (e.t - t0)
        if isinstance(e, ev.RequestsDispatched):
            dispatched[e.request_id] = t
        elif isinstance(e, ev.RequestsCompleted) and e.versions:
            m = marks[(e.agent, min(e.versions) + 1)]  # samples of policy v - 1 train into v
            m["disp"] = min(m.get("disp", t), dispatched.get(e.request_id, t))
            m["done"] = max(m.get("done", t), t)
        elif isinstance(e, ev.MicroBatchTrained):
            m = marks[(e.agent, e.version)]
            m["mb1"] = min(m.get("mb1", t), t - 1000 * e.seconds)
            m["mbN"] = max(m.get("mbN", t), t)
        elif isinstance(e, ev.WeightSyncFinished):
            marks[(e.agent, e.version)]["sync"] = t
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--skip", type=int, default=2, help="first versions left out of the medians")
    args = parser.parse_args()
    events, problem = read_events(f"{args.run_dir}/events.log")
    if problem:
        print(f"note: {problem}")
    marks = cycles(events)
    agents = list(dict.fromkeys(a for a, _ in marks))
    versions = sorted({v for _, v in marks})
    for v in versions:
        row = [f"v{v:<3d}"]
        for a in agents:
            m = marks.get((a, v), {})
            f = lambda k: f"{m[k]:8.0f}" if k in m else "       -"
            row.append(f"{a}: rollout {f('disp')}-{f('done')} train {f('mb1')}-{f('mbN')} sync {f('sync')}")
        print(" | ".join(row))
    print("\n| agent | sync to sync | rollout | wait for trainer | train | last micro-batch to synced |")
    print("|---|---|---|---|---|---|")
    for a in agents:
        steady = [v for v in versions if v > args.skip and all(k in marks.get((a, v), {}) for k in
                                                               ("disp", "done", "mb1", "mbN", "sync"))]
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        period = med([marks[(a, v)]["sync"] - marks[(a, v - 1)]["sync"]
                      for v in steady if "sync" in marks.get((a, v - 1), {})])
        stage = lambda f: med([f(marks[(a, v)]) for v in steady])
        print(f"| {a} | {period:.0f} | {stage(lambda m: m['done'] - m['disp']):.0f} | "
              f"{stage(lambda m: m['mb1'] - m['done']):.0f} | {stage(lambda m: m['mbN'] - m['mb1']):.0f} | "
              f"{stage(lambda m: m['sync'] - m['mbN']):.0f} |")
    sizes = collections.defaultdict(list)
    for e in events:
        if isinstance(e, ev.MicroBatchTrained) and e.version > args.skip:
            sizes[(e.agent, e.n)].append(1000 * e.seconds)
    print("\n| agent | samples | trainer ms per micro-batch | micro-batches |\n|---|---|---|---|")
    for (a, n), ms in sorted(sizes.items()):
        print(f"| {a} | {n} | {statistics.median(ms):.1f} | {len(ms)} |")


if __name__ == "__main__":
    main()
