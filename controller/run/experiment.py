"""`Experiment`: the controller process's lifetime, shared by the CLI and the Python API.

    async with Experiment(config) as exp:
        result = await exp.train()

    async with Experiment.resuming("runs/20260101-120000") as exp:  # after a crash
        result = await exp.train()

Entering makes the launcher `cluster.launcher` names (launcher.py; Ray's joins its cluster
and reserves room for the workers, so a missing cluster fails before anything starts),
checks the run directory can be written, binds the controller socket where the launcher
says, starts its named background tasks (receive loop, heartbeats, the event log's writer
and, with `view.enabled`, the run's web view: view/server.py, its address in
`RUN_DIR/view.url`) and either starts the workers through the launcher or waits for remote
ones to connect; once they have, a "collector" task sweeps what the run makes
(runtime/collector.py: `Sweeps`).
Workers that exit later (or whose Ray actor or node is lost) are started again by a
"launcher" task, up to `cluster.max_restarts` each; past that its failure stops the run.
`train()` runs the training driver next to those tasks: the first task to fail or end
early stops the others, so a dead receive loop can never leave training hanging. Leaving
tells every worker to shut down, waits for them under a time limit, stops the local
processes or Ray actors it started (nothing else) and closes the socket.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Coroutine, cast

from flexmarl.runtime import collector
from flexmarl.runtime import events as ev
from flexmarl.runtime.aio import StallWatch, supervise
from flexmarl.runtime.atomic import write_text_atomically
from flexmarl.runtime.config import ExperimentConfig, dump_toml, load_config
from flexmarl.runtime.eventlog import EventLog

from ..control.server import ControllerServer
from ..launch.launcher import LaunchedWorker, Launcher, RestartPolicy, WorkerFailed, WorkerRestarter, Workers
from ..launch.launchers import LAUNCHERS
from ..train.checkpoints import CheckpointError, check_writable, resume_point
from ..view.server import ViewServer
from .training import TrainingRun

log = logging.getLogger("flexmarl.controller")

# The controller holds every sample in flight and not yet committed: a heap of millions of
# small long-lived objects, nearly all freed by reference counting, not by the collector.
# At Python's default thresholds (700, 10, 10) the collector walked that heap about a
# quarter of the time at 1,024 instances (bench/RESULTS.md, the controller at scale), in
# pauses of tens of milliseconds; these make its passes rare. Set while an Experiment is
# open, restored when it closes. The cycles a run makes (the episodes' HTTP clients, each
# holding its certificate store) are bounded by `collector.Sweeps`: the start-up heap set
# apart, a full collection of the rest every few seconds, each setting the young passes
# by what it found (where the run makes next to no cycles, a backstop only:
# collector.BACKSTOP_THRESHOLDS says why).
GC_THRESHOLDS = collector.RARE_THRESHOLDS


class Experiment:
    def __init__(self, config: ExperimentConfig, *, run_dir: str | Path | None = None,
                 spawn_workers: bool = True, resume: bool = False, resume_anyway: bool = False,
                 resume_from: int | None = None) -> None:
        self.config = config
        self.run_dir = Path(run_dir or config.run.out or _default_run_dir())
        # Continue the run in run_dir from its newest intact checkpoint (see `resume`), or
        # from the checkpoint of step `resume_from`.
        self.resume = resume
        self.resume_from = resume_from
        # ... even where a setting the run's exactness depends on changed (checkpoints.check_resume)
        self.resume_anyway = resume_anyway
        self.spawn_workers = spawn_workers
        self.server = ControllerServer(config.transport)
        # The run's web view (`[view]`): it reads this run's files, and only while a page is open.
        self.view = ViewServer(self.run_dir, config.view, always=False) if config.view.enabled else None
        self.launcher: Launcher | None = None  # while open, when it starts its workers
        self.local: Workers[Any] | None = None  # the workers the launcher started
        self.restarter: WorkerRestarter | None = None  # with started workers, once they registered
        self._tasks: list[asyncio.Task] = []
        self.events: EventLog | None = None
        self.training: TrainingRun | None = None  # while train() runs
        self._gc_thresholds: tuple[int, ...] | None = None  # the process's, while we are open
        self.stall_watch = StallWatch("controller")  # a loop held over a second is logged with what held it
        self.sweeps = collector.Sweeps(adapt=True)  # full collections of what the run makes, every few seconds

    def emit(self, event: ev.Event) -> None:
        # Once a write failed, the log's task stops the run with that error; what is emitted
        # meanwhile (by anything reacting as the run stops) is dropped instead of raising
        # the same error again in each of those places.
        if self.events is not None:
            self.events.emit_unless_failed(event)

    async def flush_events(self) -> None:
        if self.events is not None:
            await self.events.flush()

    @property
    def address(self) -> str:
        return self.server.address

    def worker_ids(self, role: str) -> list[str]:
        return sorted(w.worker_id for w in self.server.registry.alive(role))

    @classmethod
    def resuming(cls, run_dir: str | Path, *, overrides: list[str] | None = None,
                 spawn_workers: bool = True, anyway: bool = False, step: int | None = None) -> "Experiment":
        """The run in `run_dir`, to be continued from its newest intact checkpoint (or the
        one of `step`) with the config it was started with (`overrides`,
        ``section.key=value``, may change e.g. run.steps to train longer)."""
        run_dir = Path(run_dir)
        if not (run_dir / "config.toml").exists():
            raise CheckpointError(f"{run_dir} is not a run directory (no config.toml); nothing to resume")
        config = load_config(run_dir / "config.toml", overrides or [])
        return cls(config, run_dir=run_dir, spawn_workers=spawn_workers, resume=True, resume_anyway=anyway,
                   resume_from=step)

    async def __aenter__(self) -> "Experiment":
        point = None
        if self.resume:
            point = resume_point(self.run_dir, self.resume_from)
            if point is None:
                raise CheckpointError(f"{self.run_dir} has no complete checkpoint to resume from; start the run "
                                      "anew (checkpoints are written every run.checkpoint_every steps)")
            if point.step >= self.config.run.steps:
                raise CheckpointError(f"{self.run_dir} is finished (checkpoint of step {point.step} of "
                                      f"{self.config.run.steps}); to train longer, resume with a larger run.steps")
            log.info("resuming %s from the checkpoint of step %d (%s)", self.run_dir, point.step, point.path)
            point.accept_changes = self.resume_anyway
        if self.spawn_workers:
            self.launcher = LAUNCHERS[self.config.cluster.launcher](self.config)
        made = not self.run_dir.exists()
        try:
            self._open_run_dir(point)
            address = self.server.bind(*self.launcher.endpoint(self.config.transport)) if self.launcher \
                else self.server.bind()
        except BaseException:
            # Nothing ran: a failed start (a bad workflow, dataset or model name) leaves no
            # run directory behind. Once workers started, their logs stay for the error.
            if made and not self.resume:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            self._close_launcher()
            raise
        write_text_atomically(self.run_dir / "controller.address", address + "\n")
        self._gc_thresholds = gc.get_threshold()  # restored by _teardown, which every exit from here runs
        gc.set_threshold(*GC_THRESHOLDS)
        self.stall_watch.start()
        self._tasks = [asyncio.create_task(self.server.serve(), name="receive"),
                       asyncio.create_task(self.server.heartbeat(), name="heartbeat")]
        if self.events is not None:
            self._tasks.append(asyncio.create_task(self.events.run(), name="event-log"))
        try:
            if self.view is not None:
                url = await self.view.start()
                write_text_atomically(self.run_dir / "view.url", url + "\n")
                log.info("the run's web view: %s", url)
                assert self.view.task is not None  # start() made it
                self._tasks.append(self.view.task)
            await self._start_workers()
        except BaseException:
            await self._teardown()
            raise
        # Started: what is tracked now (the imports, the run's set-up) lives to the end.
        self.sweeps.start()
        self._tasks.append(asyncio.create_task(self.sweeps.run(), name="collector"))
        return self

    def _open_run_dir(self, point: Any) -> None:
        # A run directory that cannot be written fails here, before any worker starts.
        check_writable(self.run_dir)
        write_text_atomically(self.run_dir / "config.toml", dump_toml(self.config))
        if self.config.run.event_log:  # nothing is written to it before its first event is
            self.events = EventLog(self.run_dir / "events.log", append=point is not None)
            if point is not None:
                self._record_damage(self.events, point.step)
        # The log says a worker died before anything reacts to it.
        self.server.on_joined.append(lambda w: self.emit(ev.WorkerJoined(w.worker_id, w.role, w.host, w.pid)))
        self.server.on_died.append(lambda w: self.emit(ev.WorkerDied(w.worker_id, w.why_gone)))
        # Built before any worker starts: a bad workflow path, dataset or model name fails here, at once.
        # The run's parts emit straight into the log (one call per event: the store, the
        # router and the pipelines emit a few events per group); `emit` is for the rest.
        emit = self.events.emit_unless_failed if self.events is not None else _dropped
        self.training = TrainingRun(self.config, self.server, self.run_dir, emit=emit,
                                    flush_events=self.flush_events, worker_ids=self.worker_ids, resume=point,
                                    restarting=self.restarting)

    def _record_damage(self, written: EventLog, step: int) -> None:
        """A resumed run records what damage to its log cost (each as EventsLost, before its
        RunResumed): the damaged stretches the log keeps and reads past, and a tail lost
        before the checkpoint of `step` it resumes from. Replay then leaves out the batches
        they split and judges the rest; a torn tail after the checkpoint (a crash) is not
        damage: the resume undoes what it held anyway."""
        recorded = {e.first_seq for e in written.intact
                    if type(e) is ev.EventsLost and e.seq != e.first_seq}  # by an earlier resume
        for lost in written.lost:
            if lost.first_seq in recorded:
                continue
            held = (f"events {lost.first_seq}-{lost.next_seq - 1}" if lost.next_seq > lost.first_seq else "no event")
            self.emit(ev.EventsLost(lost.segment, lost.offset, lost.nbytes, lost.first_seq, lost.next_seq, lost.why))
            log.warning("the event log is damaged at %s byte offset %d (%s): %s lost; the run goes on with every "
                         "intact event before and after it, and replay leaves out the batches it split",
                         lost.segment, lost.offset, lost.why, held)
        if not _reaches(written.intact, step) and written.tail is not None:
            segment, intact, size = written.tail
            why = (f"the log ends at byte {intact} of {segment.name}, before the checkpoint of step {step} this run "
                   f"resumes from")
            self.emit(ev.EventsLost(str(segment), intact, size - intact, written.next_seq, -1, why))
            log.warning("%s: what it held from there was lost (%d bytes torn); the run goes on from the "
                         "checkpoint, and replay leaves out the batches the loss split", why, size - intact)
        written.intact = []

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._teardown()

    async def _start_workers(self) -> None:
        cluster = self.config.cluster
        counts = {"rollout": cluster.rollout_workers, "trainer": cluster.trainer_workers, "env": cluster.env_workers}
        gpus = {"rollout": cluster.rollout_gpus, "trainer": cluster.trainer_gpus, "env": []}  # [] or one list per worker
        if self.launcher is not None:
            self.local = self.launcher.workers(self.address, self.run_dir / "logs")
            for role, n in counts.items():
                for i in range(n):
                    self.local.start(role, f"{role}-{i}", gpus[role][i] if gpus[role] else None)
            for name, loop in self.local.loops().items():
                self._tasks.append(asyncio.create_task(loop, name=name))
        else:
            log.info("waiting for %s to connect to %s", counts, self.address)
        waiter = asyncio.create_task(self.server.wait_for_workers(counts, cluster.worker_start_timeout_s))
        while not waiter.done():
            await asyncio.wait([waiter], timeout=0.5)
            self._check_local_processes()
        waiter.result()
        if self.local is not None:
            registry = self.server.registry
            restarter = WorkerRestarter(self.local, RestartPolicy(cluster.max_restarts, cluster.restart_backoff_s),
                                        stopping=lambda: self.server.closing,
                                        on_exit=lambda wp, why: self.server.worker_exited(wp.worker_id, why),
                                        on_restart=self._restarted,
                                        registered=lambda w: w in registry.workers and registry.workers[w].alive,
                                        start_timeout_s=cluster.worker_start_timeout_s)
            # A worker declared dead (silent, not reading) whose process is still there is
            # stopped and started again, as if it had exited.
            self.server.on_died.append(lambda w: restarter.declared_dead(w.worker_id, w.why_gone))
            self.restarter = restarter
            self._tasks.append(asyncio.create_task(restarter.run(), name="launcher"))

    def restarting(self, role: str) -> bool:
        """Whether a started worker of `role` is on its way back (see WorkerRestarter)."""
        return self.restarter is not None and self.restarter.restarting(role)

    def _restarted(self, old: LaunchedWorker, new: LaunchedWorker, restarts: int) -> None:
        self.emit(ev.WorkerRestarted(new.worker_id, new.role, old.exit_code, restarts, new.pid, why=old.why_exited()))

    def _check_local_processes(self) -> None:
        if self.local is None:
            return
        for wp in self.local.exited():
            if not self.server.registry.workers.get(wp.worker_id):
                raise WorkerFailed(f"worker {wp.worker_id}: {wp.why_exited()} before registering; its log "
                                   f"({wp.log_path}) ends with:\n{self.local.log_tail(wp)}")

    async def supervise(self, driver: Callable[[], Coroutine[Any, Any, Any]], name: str = "driver") -> Any:
        """Runs `driver()` next to the background tasks; the first failure stops all: a
        background task that ends (or fails) cancels the driver and raises `TaskEnded`."""
        main = asyncio.create_task(driver(), name=name)
        (result,) = await supervise([main], watch=self._tasks)
        return result

    async def train(self) -> Any:
        if self.training is None:
            raise RuntimeError("Experiment.train() runs inside `async with Experiment(...)`")
        return await self.supervise(self.training.run, name="training")

    async def _teardown(self) -> None:
        timeout = self.config.cluster.shutdown_timeout_s
        started = time.monotonic()
        await self.server.shut_down_workers("experiment finished", timeout)
        if self.view is not None:
            await self.view.stop()
        if self.events is not None:
            try:
                await asyncio.wait_for(self.events.close(), timeout)
            except Exception as exc:  # the error that stopped the run, if a write failed, is reported once
                log.log(logging.INFO if self.events.failed else logging.ERROR,
                        "the event log could not be closed cleanly: %s", exc)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.stall_watch.stop()
        self.server.close()
        self.sweeps.stop()
        if self._gc_thresholds is not None:
            gc.set_threshold(*self._gc_thresholds)
            self._gc_thresholds = None
        if self.local is not None:
            left = max(1.0, timeout - (time.monotonic() - started))
            await asyncio.to_thread(self.local.stop, left, min(5.0, left))
        self._close_launcher()

    def _close_launcher(self) -> None:
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None


def _reaches(events: list[ev.Event], step: int) -> bool:
    """Whether the log holds every agent's step `step` (or a resume from it, or from later)."""
    resumes = [i for i, e in enumerate(events) if type(e) is ev.RunResumed]
    if resumes and cast(ev.RunResumed, events[resumes[-1]]).step >= step:
        return True
    start = next((e for e in events if type(e) is ev.RunStarted), None)
    if start is None:
        return not events  # a log of nothing: nothing lost (a run that stopped before it began)
    since = events[resumes[-1]:] if resumes else events
    stepped = {e.agent for e in since if type(e) is ev.OptimizerStep and e.version == step}
    return set(start.agents) <= stepped


def _dropped(event: ev.Event) -> None:
    """Where events go in a run without an event log (`run.event_log = false`)."""


def _default_run_dir() -> str:
    return time.strftime("runs/%Y%m%d-%H%M%S")
