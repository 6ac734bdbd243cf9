"""`cluster.launcher = "ray"`: the workers of `flexmarl run` as Ray actors on a Ray cluster.

`RayLauncher` joins the cluster and reserves one placement group for the run (what goes
in it: ray_placement.py) before anything starts, so a missing Ray, a cluster that does not
answer or a job it has no room for stops the run at once, with one line. The controller
binds the address Ray knows this node by (where the configured one is loopback), always
with CURVE: keys made for the run (or the ones in `transport.curve_dir`); each worker's
actor is handed the client's key pair and the controller's public key as its arguments,
so no file system needs to be shared.

`RayWorkers` is the `Workers` that the restart policy (launcher.py) drives: each worker is
one `WorkerActor` (ray_actor.py) in its bundle. A worker whose process exits, whose actor
dies or whose node is lost is reported as exited; starting it again makes a new actor in
the same bundle, which Ray has moved to a node with room when the old node is gone (an
actor that finds no room within `cluster.worker_start_timeout_s` counts as exited). What
the workers write is copied into the run directory's logs/ every second (the
"worker-logs" task). A worker counts as ended only once Ray holds its actor dead: a call
to it can fail earlier, while its node is gone but Ray has not yet noticed, and an actor
restarted then would be sent to the lost node. For the same reason an actor that does not
answer a hung worker's SIGTERM is left to Ray to declare lost (`UNANSWERED_KILL_S`)
rather than killed, which would end it as "killed" and start its successor on that node.
Stopping stops exactly the actors it started; closing the launcher removes the placement
group.

Ray carries none of the run's messages: the control plane stays the controller's socket
and parameters stay on the parameter channel.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Coroutine
from urllib.parse import urlsplit

from flexmarl.runtime.config import ExperimentConfig, TransportConfig
from flexmarl.runtime.transport import create_curve_keys, is_loopback_host

from .launcher import LaunchError, log_tail, note_restart, worker_argv, worker_env
from .ray_actor import WorkerActor
from .ray_placement import PlacementPlan, describe_resources, plan_placement

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger("flexmarl.launcher")

NAMESPACE = "flexmarl"  # the Ray namespace of the runs' actors
RAY_EXTRA = "pip install 'flexmarl[ray]' (Ray 2.60.0, the version of the cluster)"
CONNECT_TIMEOUT_S = 5.0  # for the cluster's address to answer at all
LOG_COPY_S = 1.0  # how often the workers' output is copied into logs/
CALL_TIMEOUT_S = 10.0  # for one actor call while stopping
KILL_ACTOR_S = 1.0  # after a hung worker's SIGKILL went to its actor, the actor itself is killed
# An actor that did not answer the SIGTERM sent through it is killed only this long after the
# SIGKILL: its node may be gone, which Ray says (and the actor's death with it) once its
# health checks give the node up, well within this by default.
UNANSWERED_KILL_S = 60.0
KEY_FILES = ("server.key", "client.key", "client.key_secret")  # what a worker needs; never the server's secret


def control_address(configured: str, node_ip: str) -> str:
    """Where the controller binds: `configured`, or, where its host is loopback and this
    node is not, the same port on the address the Ray cluster knows this node by."""
    parts = urlsplit(configured)
    if not is_loopback_host(parts.hostname or "") or is_loopback_host(node_ip):
        return configured
    host = f"[{node_ip}]" if ":" in node_ip else node_ip
    return f"tcp://{host}:{parts.port or 0}"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise LaunchError(f"cluster.launcher = \"ray\" needs Ray, which is not installed: {RAY_EXTRA}") from None
    return ray


class RayLauncher:
    def __init__(self, config: ExperimentConfig) -> None:
        # A job Ray cannot place fails here, before Ray is even asked.
        self.plan = plan_placement(config.cluster, config.ray, config.widest_engine(), config.env.processes)
        self.cluster = config.cluster
        self.ray = import_ray()
        self.joined = not self.ray.is_initialized()  # a Python caller may have joined a cluster already
        if self.joined:
            join_cluster(self.ray, config.ray.address)
        self.tag = uuid.uuid4().hex[:8]  # names this run's actors and placement group
        try:
            self.group = reserve(self.ray, self.plan, config.ray.placement_strategy, config.ray.placement_timeout_s,
                                 f"flexmarl-{self.tag}")
        except BaseException:
            if self.joined:
                self.ray.shutdown()
            raise
        self.made_keys = ""  # a folder of keys made for this run, removed on close
        self.curve_dir = ""

    def endpoint(self, transport: TransportConfig) -> tuple[str, str]:
        address = control_address(transport.address, self.ray.util.get_node_ip_address())
        self.curve_dir = transport.curve_dir
        if not self.curve_dir:
            self.curve_dir = self.made_keys = tempfile.mkdtemp(prefix="flexmarl-keys-")
            create_curve_keys(self.curve_dir)
        return address, self.curve_dir

    def workers(self, address: str, log_dir: Path) -> "RayWorkers":
        keys = {name: (Path(self.curve_dir) / name).read_bytes() for name in KEY_FILES}
        return RayWorkers(self.ray, self.group, self.plan, self.tag, log_dir,
                          argv=lambda role, worker_id: worker_argv(role, worker_id, address,
                                                                   self.cluster.threads_per_worker,
                                                                   self.cluster.trainer_group_size),
                          env=worker_env(self.cluster.threads_per_worker), keys=keys,
                          start_timeout_s=self.cluster.worker_start_timeout_s)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception:
            log.exception("the run's placement group could not be removed")
        if self.joined:
            self.ray.shutdown()
        if self.made_keys:
            shutil.rmtree(self.made_keys, ignore_errors=True)


def join_cluster(ray: Any, address: str) -> None:
    """Connects this process to the Ray cluster at `address` as its driver."""
    from ray._private.services import canonicalize_bootstrap_address_or_die

    if address.startswith("ray://"):
        raise LaunchError(f"ray.address = {address!r} is a Ray Client address; run `flexmarl run` on a node of the "
                          f"cluster (its head, say) with ray.address = \"auto\" or HOST:PORT: the workers connect "
                          f"back to the controller")
    try:
        gcs = canonicalize_bootstrap_address_or_die(address)
    except (ConnectionError, ValueError) as exc:
        raise LaunchError(f"no Ray cluster found (ray.address = {address!r}: {_first_line(exc)}); start one with "
                          f"`ray start --head`, or set ray.address to its HOST:PORT") from None
    host, _, port = gcs.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise LaunchError(f"no Ray cluster answers at {gcs} ({exc.strerror or exc}); start it with "
                          f"`ray start --head`, or set ray.address to its HOST:PORT") from None
    # ray.init replaces the SIGTERM handler; the controller's own (an orderly shutdown) stays.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=gcs, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:
        raise LaunchError(f"could not join the Ray cluster at {gcs}: {_first_line(exc)} (the cluster must run "
                          f"Ray {ray.__version__}, as this host does)") from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    log.info("joined the Ray cluster at %s (%s)", gcs, describe_resources(ray.cluster_resources()))


def reserve(ray: Any, plan: PlacementPlan, strategy: str, timeout_s: float, name: str) -> Any:
    """The run's placement group, once Ray has placed every bundle; LaunchError past `timeout_s`."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(plan.bundles, strategy=strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise LaunchError(f"the Ray cluster has no room for the run's workers ({plan.describe()}, {strategy}; it has "
                          f"{describe_resources(ray.cluster_resources())}, {describe_resources(ray.available_resources())} "
                          f"free) after {timeout_s:g}s: add nodes, or ask for less (cluster.rollout_workers, "
                          f"cluster.threads_per_worker, GPUs), or wait longer (ray.placement_timeout_s)")
    log.info("placement group %s: %s, %s", name, plan.describe(), strategy)
    return group


@dataclass
class RayWorker:
    """One worker's current Ray actor, from its start until it is seen gone."""

    worker_id: str
    role: str
    log_path: Path
    name: str  # the actor's, in NAMESPACE
    actor: Any
    exited_ref: Any  # resolves with the process's exit code, or fails when the actor is lost
    placed_ref: Any  # resolves once the actor runs and its process started: WorkerActor.where()
    started_at: float
    where: dict[str, Any] = field(default_factory=dict)  # node, ip, host, pid, once placed
    code: int | None = None
    outcome: str = ""  # how it ended, once it did
    copied: int = 0  # bytes of its output already in log_path
    kill_at: float | None = None  # when its actor is killed (a hung worker being stopped)
    signalled: Any = None  # the last signal call through its actor: resolves once the actor answered

    @property
    def pid(self) -> int:
        return int(self.where.get("pid", 0))

    @property
    def exit_code(self) -> int | None:
        return self.code

    def alive(self) -> bool:
        return not self.outcome

    def ended(self) -> str:
        return self.outcome

    def why_exited(self) -> str:
        return f"its {self.describe()} {self.outcome}"

    def describe(self) -> str:
        return f"Ray actor {self.name} ({self.placement()})"

    def placement(self) -> str:
        if not self.where:
            return "not placed"
        return f"worker pid {self.pid} on node {self.where['node']} at {self.where['ip']}"


class RayWorkers:
    def __init__(self, ray: ModuleType, group: PlacementGroup, plan: PlacementPlan, tag: str, log_dir: Path, *,
                 argv: Callable[[str, str], list[str]], env: dict[str, str], keys: dict[str, bytes],
                 start_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ray = ray
        self.group = group
        self.plan = plan
        self.tag = tag
        self.log_dir = log_dir
        self.argv = argv
        self.env = env
        self.keys = keys
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.actor_class = ray.remote(max_concurrency=4)(WorkerActor)  # wait() blocks one thread
        self.procs: list[RayWorker] = []  # the current actor of every worker id
        self.retired: list[RayWorker] = []  # earlier actors of restarted workers
        self.started = 0  # actors made, for unique names

    def start(self, role: str, worker_id: str, gpus: list[int] | None = None) -> RayWorker:
        """Starts `worker_id`'s actor in its bundle, with the resources the plan gives it
        (Ray picks the GPUs; `gpus` is the local launcher's)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        need = self.plan.workers[worker_id]
        self.started += 1
        name = f"flexmarl-{self.tag}-{worker_id}-{self.started}"
        env = dict(self.env, **({} if need.gpus else {"CUDA_VISIBLE_DEVICES": ""}))  # no GPU it was not given
        actor = self.actor_class.options(
            name=name, namespace=NAMESPACE, num_cpus=need.cpus, num_gpus=need.gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=need.bundle),
        ).remote(self.argv(role, worker_id), env, self.keys)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        worker = RayWorker(worker_id, role, self.log_dir / f"{worker_id}.log", name, actor, actor.wait.remote(),
                           actor.where.remote(), self.clock())
        self.procs.append(worker)
        log.info("started %s worker %s as Ray actor %s (bundle %d)", role, worker_id, name, need.bundle)
        return worker

    def restart(self, old: RayWorker) -> RayWorker:
        """Starts `old`'s worker again as a new actor in the same bundle; the new one takes
        `old`'s place in `procs`."""
        self._finish(old)
        self._kill(old)
        note_restart(old.log_path, f"{old.describe()} {old.outcome}")
        new = self.start(old.role, old.worker_id)
        self.procs.remove(new)
        self.procs[self.procs.index(old)] = new
        self.retired.append(old)
        return new

    def exited(self) -> list[RayWorker]:
        """Workers whose process exited, whose actor or node was lost, or that found no room
        within the start timeout; the others' placements are noted as they happen."""
        running = [w for w in self.procs if not w.outcome]
        for worker in running:
            if worker.kill_at is not None and self.clock() >= worker.kill_at:
                worker.kill_at = None
                self._kill(worker)  # its exited_ref then fails: seen as ended below, or at the next look
        self._note_placements([w for w in running if not w.where])
        ready = self._ready([w.exited_ref for w in running])
        for worker in running:
            if worker.exited_ref in ready:
                self._ended(worker)
            elif not worker.where and self.clock() - worker.started_at > self.start_timeout_s:
                worker.outcome = (f"was not placed within {self.start_timeout_s:g}s: no node has room for "
                                  f"bundle {self.plan.workers[worker.worker_id].bundle} of the run")
                self._kill(worker)
        return [w for w in self.procs if w.outcome]

    def log_tail(self, worker: RayWorker) -> str:
        return log_tail(worker.log_path)

    def signal(self, worker: RayWorker, sig: int) -> None:
        """Stops a hung worker without waiting on Ray: SIGTERM goes to its process through
        its actor; SIGKILL goes there too, and `KILL_ACTOR_S` later (`exited` looks) its
        actor is killed, so a worker whose actor or node no longer answers ends as well
        (`UNANSWERED_KILL_S` later where the actor did not answer the SIGTERM: Ray is left
        to declare its node lost first)."""
        unanswered = worker.signalled is not None and not self._answered(worker.signalled)
        if worker.where:
            worker.signalled = worker.actor.signal.remote(sig)
        if sig == signal.SIGKILL or not worker.where:  # never placed: no process to signal
            wait = UNANSWERED_KILL_S if unanswered else KILL_ACTOR_S
            worker.kill_at = self.clock() + (wait if worker.where else 0.0)

    def reclaim(self, worker: RayWorker) -> None:
        """Has the actor remove what its exited process left on its node (a rollout engine's
        directories); nothing to do where the actor or its node is gone."""
        if not worker.where:
            return
        try:
            removed = self.ray.get(worker.actor.reclaim.remote(), timeout=CALL_TIMEOUT_S)
        except self.ray.exceptions.RayError:
            return
        if removed:
            log.info("removed %d directories left by %s (%s)", removed, worker.worker_id, worker.describe())

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"worker-logs": self._copy_output()}

    def stop(self, timeout: float = 10.0, grace: float = 0.0) -> None:
        """Waits `grace` seconds for workers already told to shut down, has each actor stop
        its process (SIGTERM, SIGKILL after `timeout`), copies the rest of their output,
        then kills every actor this launcher started, and nothing else."""
        running = [w for w in self.procs if not w.outcome]
        if grace > 0 and running:
            self.ray.wait([w.exited_ref for w in running], num_returns=len(running), timeout=grace)
        stopping = [w.actor.stop.remote(timeout) for w in running if w.where]
        if stopping:
            self.ray.wait(stopping, num_returns=len(stopping), timeout=timeout + CALL_TIMEOUT_S)
        for worker in self.procs + self.retired:
            self._finish(worker)
            self._kill(worker)

    def _answered(self, ref: Any) -> bool:
        if not self._ready([ref]):
            return False
        try:
            self.ray.get(ref)
        except self.ray.exceptions.RayError:
            return False
        return True

    def _ready(self, refs: list[Any]) -> set[Any]:
        if not refs:
            return set()
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        return set(ready)

    def _note_placements(self, unplaced: list[RayWorker]) -> None:
        ready = self._ready([w.placed_ref for w in unplaced])
        for worker in unplaced:
            if worker.placed_ref not in ready:
                continue
            try:
                worker.where = self.ray.get(worker.placed_ref)
            except self.ray.exceptions.RayError:
                continue  # its exited_ref says why
            with open(worker.log_path, "a") as fh:
                fh.write(f"--- {worker.describe()}, host {worker.where['host']} ---\n")
            log.info("worker %s: %s", worker.worker_id, worker.describe())

    def _ended(self, worker: RayWorker) -> None:
        try:
            worker.code = self.ray.get(worker.exited_ref)
            worker.outcome = f"exited with code {worker.code}"
        except self.ray.exceptions.RayError as exc:
            if self._actor_state(worker) != "DEAD":
                return  # Ray has not given the actor up yet: its node may be gone unnoticed; looked at again
            node = worker.where.get("node")
            if node and not any(n["NodeID"] == node and n["Alive"] for n in self.ray.nodes()):
                worker.outcome = "was lost with its node"
            else:
                worker.outcome = f"died: {_last_line(exc)}"

    def _actor_state(self, worker: RayWorker) -> str:
        """The actor's state as Ray's control store holds it: ALIVE, RESTARTING, DEAD, ..."""
        return self.ray._private.state.actors(actor_id=worker.actor._actor_id.hex()).get("State", "DEAD")

    def _finish(self, worker: RayWorker) -> None:
        """Copies what `worker` wrote that is not in its log yet, where its actor still answers."""
        if not worker.where or worker.copied < 0:
            return
        try:
            rest = self.ray.get(worker.actor.finish.remote(worker.copied), timeout=CALL_TIMEOUT_S)
        except self.ray.exceptions.RayError:
            rest = b""  # the actor or its node is gone, and its last output with it
        self._append(worker, rest)
        worker.copied = -1  # nothing more to copy

    def _kill(self, worker: RayWorker) -> None:
        try:
            self.ray.kill(worker.actor, no_restart=True)
        except Exception:  # already gone with its node
            log.debug("Ray actor %s was gone already", worker.name)

    def _append(self, worker: RayWorker, data: bytes) -> None:
        if data:
            with open(worker.log_path, "ab") as fh:
                fh.write(data)
            worker.copied += len(data)

    async def _copy_output(self) -> None:
        while True:
            await asyncio.sleep(LOG_COPY_S)
            live = [w for w in self.procs if w.where and w.copied >= 0]
            chunks = await asyncio.gather(*(asyncio.wrap_future(w.actor.output.remote(w.copied).future())
                                            for w in live), return_exceptions=True)
            for worker, chunk in zip(live, chunks):
                if isinstance(chunk, bytes) and worker.copied >= 0:
                    self._append(worker, chunk)


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
