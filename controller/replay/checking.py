"""`flexmarl replay --check`: the controller's decisions re-driven from the logged inputs
(redrive.py) and compared with the log, the first difference named.

`check(events)` compares in this process; `check_beside(events)` shares the re-drive with
a forked child where the process may use a second core, so that the command takes about
the longest of the summary and the check, not their sum.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any, Callable

from flexmarl.runtime import collector
from flexmarl.runtime.events import Event, GroupOpened, MicroBatchFormed, RunStarted, without_stamp

from .lineage import agent_roles, lineage, open_steps


@collector.rare_collections()
def check(events: list[Event], redrive: Callable[[list[Event]], list[Event]] | None = None,
          types: tuple | None = None) -> str | None:
    """Re-drives the controller's decision code from the logged inputs (`redrive`, by
    default redrive.py's, which the summary alone does not load); returns a message naming
    the first decision of `types` (by default the ones it derives) that differs from the
    log, or None when all agree. Stamps (seq and t) are ignored. A step left open by a run
    that stopped mid-step is compared as far as the log goes: its logged micro-batches must
    be the first the rules cut; the ones not cut when the log ends are not a difference."""
    from . import redrive as redriving

    redrive = redrive or redriving.redrive
    wanted = frozenset(types or redriving.REDRIVEN_TYPES)
    counted = lineage(events)
    logged = [e for e in counted if type(e) in wanted]
    unfinished = open_steps(counted)
    left = collections.Counter((e.agent, e.version) for e in logged
                               if type(e) is MicroBatchFormed and (e.agent, e.version) in unfinished)
    again = []
    for e in redrive(events):
        if type(e) not in wanted:
            continue
        if type(e) is MicroBatchFormed and (e.agent, e.version) in unfinished:
            if not left[(e.agent, e.version)]:
                continue  # not cut yet when the log ends
            left[(e.agent, e.version)] -= 1
        again.append(e)
    for i, (a, b) in enumerate(zip(logged, again)):
        if without_stamp(a) != without_stamp(b):
            return (f"decision {i} differs: the log has (seq {a.seq}, t {a.t:.3f} s) {without_stamp(a)}; "
                    f"re-driving made {without_stamp(b)}")
    if len(logged) != len(again):
        n = min(len(logged), len(again))
        extra = without_stamp(logged[n]) if len(logged) > n else without_stamp(again[n])
        return (f"the log has {len(logged)} decisions, re-driving made {len(again)}; "
                f"first unmatched: {extra}")
    return None


def check_beside(events: list[Event]) -> Callable[[], str | None]:
    """Starts `check(events)` and returns what waits for its answer. Where this process may
    run on more than one core, the re-drive is shared: a forked child (it has the events
    without a copy) re-drives most of the agents while this process makes the summary,
    then re-drives the rest when the answer is asked for, joins the two and compares; the
    command takes about the longest of the two, not their sum. On one core it all runs
    here, when asked for; a child that dies leaves its share to this process."""
    run = next((e for e in events if type(e) is RunStarted), None)
    if len(os.sched_getaffinity(0)) < 2 or run is None:
        return lambda: check(events)
    import multiprocessing  # only here: most replays are not checked

    from . import redrive as redriving

    theirs, mine = _shares(events, agent_roles(run).trained)
    context = multiprocessing.get_context("fork")
    for stream in (sys.stdout, sys.stderr):  # the child's exit flushes its copy of what is still buffered
        stream.flush()
    answers, answer = context.Pipe(duplex=False)
    child = context.Process(target=_decisions_into, args=(events, theirs, answer), name="replay-check", daemon=True)
    child.start()
    answer.close()  # the child's end: the parent reads EOF if the child dies without answering

    def answered() -> str | None:
        counted = lineage(events)
        try:
            made = redriving.training_decisions(counted, mine)
            try:
                made.update(answers.recv())
            except EOFError:  # the child's re-drive raised, or it died (killed, out of memory): its share here
                made.update(redriving.training_decisions(counted, theirs))
        finally:
            answers.close()
            child.join()
        joined = redriving.in_log_order(counted, {a: made[a] for a in run.agents if a in made},
                                        redriving.balancer_moves(counted), redriving.episode_assignments(counted))
        return check(events, lambda _: joined)
    return answered


# The part of the re-drive's work the child takes: this process also makes the summary,
# about half a re-drive's time.
CHILD_SHARE = 0.8


def _shares(events: list[Event], agents: list[str]) -> tuple[list[str], list[str]]:
    """The run's agents in two shares, the child's and this process's, the child's about
    CHILD_SHARE of the groups opened (what the re-drive's time goes with)."""
    groups = collections.Counter(e.agent for e in events if type(e) is GroupOpened)
    wanted, taken, theirs = CHILD_SHARE * sum(groups.values()), 0, []
    for agent in sorted(agents, key=lambda a: -groups[a]):
        if taken + groups[agent] / 2 <= wanted:
            theirs.append(agent)
            taken += groups[agent]
    return theirs, [a for a in agents if a not in theirs]


def _decisions_into(events: list[Event], agents: list[str], answer: Any) -> None:
    """In the forked child: the re-drive's training decisions of `agents` into the pipe;
    nothing if it raised, and no traceback here: the parent then re-drives them itself and
    raises the same error there, once."""
    from .redrive import training_decisions

    try:
        made = training_decisions(lineage(events), agents)
    except Exception:
        answer.close()
        return
    answer.send(made)
    answer.close()


