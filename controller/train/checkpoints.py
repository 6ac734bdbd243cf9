"""Checkpoints: consistent cuts of the whole run, written atomically, the last N kept; and
finding the one a run resumes from.

Layout of RUN_DIR/checkpoints/::

    step-000010/                  one consistent cut: every agent at version 10
        controller.json           the controller's state at the cut (see `controller_state`)
        AGENT/                    Hugging Face weights: config.json, model.safetensors, tokenizer
                              (trained agents only: a frozen one is named in controller.json's
                              "frozen" by its model, or its source agent and version)
            training_state.flexmarl   weights, optimizer state, version (a parameter-channel
                                      disk file, which any trainer can load)
        manifest.sha256           the SHA-256 of every file above, written last
    .step-000012.partial/         being written: each agent saves into it after its step 12
    final -> step-000020          the last step's checkpoint

Why a cut is consistent: each agent's pipeline saves right after its optimizer step t and
weight sync, before it sends anything of batch t + 1, so no gradient is pending; once the
last agent saved t, the controller writes its own state into the staging directory and
then the manifest, and only then renames it into place. A crash (or a full disk) before the
rename leaves a `.partial` directory that is never resumed from; the previous checkpoints
stay whole. A checkpoint is checked against its manifest before a resume uses it
(`resume_point`): one whose files changed since is named and passed over for the newest
intact one; the trainer and the rollout engine check the files they load again.
What the store held past the cut (samples of batches after t, in async mode) is not kept:
a resumed run generates those batches again, from the same per-episode seeds. Under
continuous admission an episode is not its starting batch's, so the cut names them
(`controller_state`'s "episodes"): every episode begun that no batch up to t trains (still
running, or ended and taken by a later batch), with its dataset row, and where the
episodes not begun yet start; a resume begins exactly those again, then the rest.

It does not know how agents are trained or placed: it is handed a `call` to reach a
trainer and a function that gives the controller's state (`controller_state` says what
it holds).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.atomic import sync_dir, write_text_atomically
from flexmarl.runtime.checksums import MANIFEST, DamagedFile, entries_under, read_manifest, verify_files, write_manifest
from flexmarl.runtime.config import ConfigError, admits_continuously, dump_toml
from flexmarl.runtime.params.types import ParamHandle

from ..control.interfaces import Emit, WorkerCalls
from ..control.server import WorkerDied

log = logging.getLogger("flexmarl.checkpoints")

CONTROLLER_STATE = "controller.json"
TRAINING_STATE_FILE = protocol.TRAINING_STATE_FILE
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
# A run directory needs at least this much free space to start (config, logs, metrics).
MIN_FREE_BYTES = 16 * 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (or read). Earlier checkpoints are untouched."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass
class ResumePoint:
    """The last complete checkpoint of a run directory."""

    path: Path
    step: int
    state: dict[str, Any]  # controller.json
    # The user said to go on although a setting the run's exactness depends on changed
    # (`resume_changes`): the run continues from the saved data position with the new one.
    accept_changes: bool = False
    manifest: dict[str, str] = field(default_factory=dict)  # file -> SHA-256, checked when chosen

    def agent_dir(self, agent: str) -> Path:
        return self.path / agent

    def agent_checksums(self, agent: str) -> dict[str, str]:
        """The digests of the files in the agent's directory, for whoever loads them."""
        return entries_under(self.manifest, agent)

    def training_state(self, agent: str) -> ParamHandle:
        """The handle of the agent's training state file, pointing at where the file is now
        (it was written under a staging name)."""
        path = self.agent_dir(agent) / TRAINING_STATE_FILE
        if not self.state.get("full_state", True):
            raise CheckpointError(f"checkpoint {self.path} holds weights only (its run used trainer groups); "
                                  "it cannot be resumed from, but its weights load as a Hugging Face model")
        if not path.exists():
            raise CheckpointError(f"checkpoint {self.path} has no training state for {agent!r} ({path} is missing)")
        return read_state(path)

    def training_state_checksum(self, agent: str) -> str:
        return self.agent_checksums(agent).get(TRAINING_STATE_FILE, "")


# Settings a resumed run must share with its checkpoint to continue the same run exactly:
# controller.json key -> (config key, the value now). run.steps is not one: any may follow.
def exactness_settings(cfg: Any, dataset: Any) -> dict[str, tuple[str, Any]]:
    return {"seed": ("run.seed", cfg.run.seed),
            "queries_per_step": ("pipeline.queries_per_step", cfg.pipeline.queries_per_step),
            # the rows themselves, wherever the file now is (None: no dataset)
            "data_fingerprint": ("data.train (its rows)", dataset.fingerprint() if dataset is not None else None),
            "data_shuffle": ("data.shuffle", cfg.data.shuffle),
            "data_epochs": ("data.epochs", cfg.data.epochs)}


def resume_changes(point: ResumePoint, settings: dict[str, tuple[str, Any]]) -> list[str]:
    """What differs between the checkpoint's exactness settings and `settings`, each as
    "KEY was OLD, now NEW" (a key the checkpoint did not record is not compared)."""
    return [f"{name} was {point.state[key]!r}, now {value!r}" for key, (name, value) in settings.items()
            if key in point.state and point.state[key] != value]


def check_resume(point: ResumePoint, settings: dict[str, tuple[str, Any]]) -> list[str]:
    """Refuses a resume that changed an exactness setting, naming it, unless the user
    accepted the changes (then they are returned, to be logged)."""
    changes = resume_changes(point, settings)
    if changes and not point.accept_changes:
        raise CheckpointError(
            f"resuming from {point.path} would not continue the same run: {'; '.join(changes)}. The samples "
            "and the data order depend on these: set them back (--set KEY=VALUE), or pass --resume-anyway to "
            "go on with them changed (the data then continues from the checkpoint's position)")
    return changes


def read_state(path: Path) -> ParamHandle:
    """The handle of a training state file, pointing at where the file is now (it was
    written under a staging name). Raises FileNotFoundError when it is not there."""
    from flexmarl.runtime.params.disk import read_handle  # torch, only when a state is read

    return msgspec.structs.replace(read_handle(path), path=str(path))


def latest_checkpoint(run_dir: str | Path) -> ResumePoint | None:
    """The newest complete checkpoint under RUN_DIR/checkpoints (staging directories are
    never complete), or None when there is none."""
    found = [(step, path) for step, path in checkpoint_dirs(run_dir) if (path / MANIFEST).exists()]
    if not found:
        return None
    step, path = found[0]
    return ResumePoint(path, step, _controller_state(path, step))


def checkpoint_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint directory renamed into place, newest first."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for d in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and not d.is_symlink():
            found.append((int(m.group(1)), d))
    return sorted(found, reverse=True)


def _controller_state(path: Path, step: int) -> dict[str, Any]:
    try:
        state = json.loads((path / CONTROLLER_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / CONTROLLER_STATE}: {exc}") from exc
    if state.get("format") != FORMAT or state.get("step") != step:
        raise CheckpointError(f"{path / CONTROLLER_STATE} is not a format-{FORMAT} state of step {step}")
    return state


def verified(path: Path, step: int) -> ResumePoint:
    """The checkpoint in `path` once every file its manifest lists matches its digest;
    raises DamagedFile naming the first that does not (or the manifest)."""
    manifest = read_manifest(path)
    verify_files(path, manifest)
    try:
        state = _controller_state(path, step)
    except CheckpointError as exc:
        raise DamagedFile(path / CONTROLLER_STATE, f"is not a checkpoint's state: {exc}") from None
    return ResumePoint(path, step, state, manifest=manifest)


def resume_point(run_dir: str | Path, step: int | None = None,
                 warn: Callable[[str], None] = log.warning, use: tuple[str, str] = ("resumed from", "resuming from")
                 ) -> ResumePoint | None:
    """The checkpoint a resume starts from, checked against its manifest: the one of `step`
    (an error naming the damaged file if it fails the check), or the newest intact one,
    each damaged newer one named through `warn` and passed over. None: no checkpoint.
    `use` says what is done with it, for those lines ("served", "serving")."""
    candidates = checkpoint_dirs(run_dir)
    if step is not None:
        chosen = [(s, p) for s, p in candidates if s == step]
        if not chosen:
            have = ", ".join(step_dir_name(s) for s, _ in candidates) or "none"
            raise CheckpointError(f"{run_dir} has no checkpoint of step {step} (it has: {have})")
        try:
            return verified(chosen[0][1], step)
        except DamagedFile as exc:
            raise CheckpointError(f"the checkpoint of step {step} is damaged: {exc}; resume from another "
                                  "(--resume-from step-N), or leave --resume-from out for the newest intact "
                                  "one") from None
    damaged = []
    for s, path in candidates:
        try:
            point = verified(path, s)
        except DamagedFile as exc:
            damaged.append(f"step {s}: {exc}")
            warn(f"the checkpoint of step {s} is damaged and is not {use[0]}: {exc}")
            continue
        if damaged:
            warn(f"{use[1]} the checkpoint of step {s} instead, the newest intact one")
        return point
    if damaged:
        raise CheckpointError(f"every checkpoint of {run_dir} is damaged ({'; '.join(damaged)}); the run "
                              f"cannot be {use[0].split()[0]}")
    return None


def check_writable(run_dir: Path, need_bytes: int = MIN_FREE_BYTES) -> None:
    """Raises CheckpointError, saying what to do, when the run directory cannot be created,
    written and synced, or has less than `need_bytes` free."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"the run directory {run_dir} is not writable: {exc.strerror or exc}; "
                              "choose another with --out (or run.out)") from exc
    free = shutil.disk_usage(run_dir).free
    if free < need_bytes:
        raise CheckpointError(f"the run directory {run_dir} has {free / 2**20:.1f} MiB free, and needs at least "
                              f"{need_bytes / 2**20:.1f} MiB; free some space or choose another with --out")


def controller_state(cfg: Any, step: int, assignment: dict[str, list[str]], store_after_cut: dict[str, int],
                     dataset: Any, next_episode: int, versions: Any = None,
                     episodes: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the controller adds to a checkpoint of `step`: enough to continue the run from
    it and to say where it stood. Episodes draw their randomness from seeds made of
    (run.seed, batch, episode), so the seed and the step are the random state; the
    settings exactness depends on are recorded for the resume to compare.
    `store_after_cut`: samples of later batches the store held per agent (a resumed run
    makes them again); `dataset`: the training data, or None; `next_episode`: the number
    of the first episode after the cut; `versions`: the synced versions (a snapshot's);
    `episodes`: under continuous admission, the producer's `in_flight` record (the episodes
    no batch up to `step` trains, each given its dataset row here as [epoch, row]).
    Frozen agents are named by their source, never copied (`frozen_sources`)."""
    frozen = frozen_sources(cfg, versions)
    state = {"steps": cfg.run.steps,
             **{key: value for key, (_, value) in exactness_settings(cfg, dataset).items()},
             "versions": {a: step for a in cfg.agents if a not in frozen},
             "frozen": frozen,
             "episodes_done": next_episode,
             "rollout_assignment": {a: list(ws) for a, ws in assignment.items()},
             "store_after_cut": dict(store_after_cut),
             "admission": cfg.pipeline.admission,
             "config_toml": dump_toml(cfg)}
    if episodes is not None:
        state["episodes"] = {**episodes, "in_flight": [
            {**b, "row": _row(dataset, b["number"])}
            for b in episodes["in_flight"]]}
    state["data"] = {"next_episode": next_episode}
    if dataset is not None and step < cfg.run.steps:  # after the last step the data may be used up
        position = dataset.position(next_episode)
        state["data"].update(epoch=position.epoch, next_row=position.index)
    return state


def _row(dataset: Any, number: int) -> list[int] | None:
    """Episode `number`'s dataset row as [epoch, row index], or None without a dataset."""
    if dataset is None:
        return None
    position = dataset.position(number)
    return [position.epoch, position.index]


def frozen_sources(cfg: Any, versions: Any = None) -> dict[str, dict[str, Any]]:
    """What each frozen agent's weights are, named instead of copied into a checkpoint:
    its model, its base and adapter directory, or the agent a snapshot copies and at
    which version (`versions`, the synced ones; a resumed run's snapshot is loaded from
    its source's weights at the resumed step)."""
    sources: dict[str, dict[str, Any]] = {}
    for name, agent in cfg.agents.items():
        if agent.snapshot_of:
            sources[name] = {"snapshot_of": agent.snapshot_of, "every": agent.snapshot_every,
                             "version": versions[name] if versions is not None else None}
        elif not agent.train:
            sources[name] = ({"base": cfg.bases[agent.base].model, "adapter": agent.adapter} if agent.base
                             else {"model": agent.model})
    return sources


def resume_placement(resume: ResumePoint | None, units: Any, workers: list[str]) -> dict[str, list[str]] | None:
    """Each engine unit's rollout workers as at the checkpoint, where the same rollout
    workers are here; else None (they are placed anew)."""
    saved = resume.state.get("rollout_assignment") if resume is not None else None
    if saved and sorted({w for ws in saved.values() for w in ws}) == sorted(workers):
        return {name: list(saved[u.agents[0]]) for name, u in units.items()}
    return None


def at_checkpoint(message: protocol.LoadModel, resume: ResumePoint | None, unit: Any) -> protocol.LoadModel:
    """The load message of a resumed run's initial placement: a whole-model engine starts
    on the checkpoint's weights at its step (an adapter base starts on its base, the
    adapters are synced next; a frozen agent's engine on its own model, the checkpoint
    naming it). Unchanged without a resume."""
    if resume is None or unit.lora or unit.agents[0] in resume.state.get("frozen", {}):
        return message
    first = unit.agents[0]
    return msgspec.structs.replace(message, model_path=str(resume.agent_dir(first).resolve()), version=resume.step,
                                   checksums=resume.agent_checksums(first))


def saved_admission(resume: ResumePoint) -> str:
    """The admission the checkpoint's run used ("step" for one written before it was recorded,
    unless its config says otherwise)."""
    if "admission" in resume.state:
        return str(resume.state["admission"])
    try:
        return str(tomllib.loads(resume.state.get("config_toml", "")).get("pipeline", {}).get("admission", "step"))
    except tomllib.TOMLDecodeError:
        return "step"


def resume_counters(resume: ResumePoint, run_dir: Path, schedule: Any, versions: Any) -> None:
    """A resumed run continues after the checkpoint: the metrics rows of later batches are
    dropped (made again), the schedule starts at the next batch, every agent at its step.
    A checkpoint of a continuous-admission run resumes only under continuous admission
    (under step admission, each batch trains the episodes it started: those taken early by
    an earlier batch would train twice) and only with its episodes in flight recorded."""
    saved = saved_admission(resume)
    if admits_continuously(saved):
        if "episodes" not in resume.state:
            raise ConfigError(f"the checkpoint of step {resume.step} was written under pipeline.admission = "
                              f"{saved!r} without its episodes in flight, so a resume would lose or repeat "
                              "some; start the run again, or resume from a checkpoint this version wrote")
        if not schedule.continuous:
            raise ConfigError(f"the checkpoint of step {resume.step} was written under pipeline.admission = "
                              f"{saved!r} (its batches train the first episodes to end, not the ones they "
                              f"started): resume it with --set pipeline.admission={saved}")
    truncate_metrics(run_dir / "metrics.jsonl", resume.step)
    schedule.resume_after(resume.step, resume.state.get("episodes", {}).get("spares_over", 0))
    versions.resume_at(resume.step, schedule.agents + list(schedule.snapshots))  # a frozen agent stays at 0


def continue_episodes(resume: ResumePoint, cfg: Any, dataset: Any, episodes: Any) -> None:
    """The episodes continue at the saved data position, whatever the batch size now (under
    continuous admission, after the episodes in flight at the cut, begun again); settings
    changed since the checkpoint (accepted) are logged."""
    for change in check_resume(resume, exactness_settings(cfg, dataset)):
        log.warning("resuming with a changed setting, as asked: %s", change)
    saved = resume.state.get("data", {}).get("next_episode", resume.step * cfg.pipeline.queries_per_step)
    episodes.continue_data(resume.step + 1, saved)
    if "episodes" in resume.state:  # continuous admission: those in flight at the cut are begun again
        episodes.redraw(resume.state["episodes"])


def truncate_metrics(path: Path, step: int) -> None:
    """Drops metrics rows a resumed run writes again: training rows after `step`, and
    evaluations from `step` on (one at `step` may have been cut short). Atomic."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line torn by the crash
            continue
        limit = step - 1 if row.get("kind") == "eval" else step
        if row.get("step", 0) <= limit:
            kept.append(line)
    write_text_atomically(path, "".join(line + "\n" for line in kept))


class Checkpointer:
    def __init__(self, root: Path, agents: list[str], *, every: int, keep: int, steps: int, server: WorkerCalls,
                 emit: Emit, controller_state: Callable[[int], dict[str, Any]],
                 full_state: bool = True) -> None:
        self.root = Path(root)
        # False: weights only (trainer groups do not save their sharded state yet); such
        # checkpoints cannot be resumed from or restore an agent.
        self.full_state = full_state
        self.agents = list(agents)
        self.every = every
        self.keep = max(1, keep)
        self.steps = steps
        self.server = server
        self.emit = emit
        self.controller_state = controller_state
        self._saved: dict[int, dict[str, int]] = {}  # step -> agent -> bytes written
        self._started: dict[int, float] = {}
        self.written: list[int] = []

    def due(self, step: int) -> bool:
        return step == self.steps or (self.every > 0 and step % self.every == 0)

    def agent_state(self, agent: str, step: int) -> ParamHandle:
        """The handle of `agent`'s saved training state of `step`, wherever it is now (in
        the step's checkpoint, or its staging directory while other agents still save)."""
        if not self.full_state:
            raise CheckpointError(f"the checkpoints of this run hold weights only (trainer groups), so the "
                                  f"training state of {agent} cannot be restored")
        for d in (self.root / step_dir_name(step), self.staging(step), self.root / step_dir_name(step)):
            try:
                return read_state(d / agent / TRAINING_STATE_FILE)
            except FileNotFoundError:
                continue  # renamed in between: look again
        raise CheckpointError(f"the saved training state of {agent} at step {step} is gone from {self.root}")

    def agent_state_checksum(self, agent: str, step: int) -> str:
        """The SHA-256 of `agent`'s training state file of `step` from its checkpoint's
        manifest; "" while the checkpoint is still being written (no manifest yet)."""
        try:
            manifest = read_manifest(self.root / step_dir_name(step))
        except DamagedFile:
            return ""
        return entries_under(manifest, agent).get(TRAINING_STATE_FILE, "")

    async def intact_state(self, agent: str, step: int) -> tuple[ParamHandle, str]:
        """`agent`'s saved training state of `step` and its checksum, once its file matches
        the checkpoint's manifest (hashed in a thread; a state whose checkpoint is still
        being written has no manifest yet and is taken as written). Raises DamagedFile
        naming the file when it does not match, CheckpointError when it is gone."""
        import asyncio

        checksum = self.agent_state_checksum(agent, step)
        if checksum:  # the checkpoint is complete: its file is in place
            await asyncio.to_thread(verify_files, self.root / step_dir_name(step) / agent,
                                    {TRAINING_STATE_FILE: checksum})
        return self.agent_state(agent, step), checksum

    def staging(self, step: int) -> Path:
        return self.root / f".{step_dir_name(step)}.partial"

    async def save_agent(self, agent: str, trainer: str, step: int) -> None:
        """Writes `agent`'s training state after its step `step` (nothing accumulated) into
        the step's staging directory; the last agent's save completes the checkpoint."""
        staging = self.staging(step)
        if step not in self._saved:
            self._check_space(step)
            self._started[step] = time.monotonic()
            try:
                shutil.rmtree(staging, ignore_errors=True)  # left by a crash before a resume
                staging.mkdir(parents=True)
            except OSError as exc:
                raise self._failed(step, f"cannot create {staging}: {exc.strerror or exc}") from exc
            self._saved[step] = {}
        try:
            reply, _ = await self.server.call(trainer, protocol.SaveCheckpoint(
                self.server.next_request_id(), agent, str((staging / agent).resolve()), full_state=self.full_state))
        except WorkerDied:
            raise  # the agent's state died with its trainer: its pipeline restores it and saves again
        except Exception as exc:
            self._saved.pop(step, None)
            shutil.rmtree(staging, ignore_errors=True)
            raise self._failed(step, str(exc)) from exc
        self._saved[step][agent] = reply.nbytes
        if len(self._saved[step]) == len(self.agents):
            self._finalize(step)

    def _finalize(self, step: int) -> None:
        staging, final = self.staging(step), self.root / step_dir_name(step)
        saved = self._saved.pop(step)
        state = {"format": FORMAT, "step": step, "full_state": self.full_state, **self.controller_state(step),
                 "agents": {a: {"dir": a, "training_state": f"{a}/{TRAINING_STATE_FILE}", "bytes": n}
                            for a, n in saved.items()}}
        try:
            write_text_atomically(staging / CONTROLLER_STATE, json.dumps(state, indent=1, sort_keys=True),
                                  durable=True)
            write_manifest(staging)  # last: a checkpoint is complete only with it
            if final.exists():  # written before a crash, then the run resumed from an earlier one
                shutil.rmtree(final)
            os.rename(staging, final)
            sync_dir(self.root)
            if step == self.steps:
                link = self.root / "final"
                tmp = self.root / ".final.tmp"
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(final.name)
                os.replace(tmp, link)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise self._failed(step, f"{exc.strerror or exc}") from exc
        seconds = time.monotonic() - self._started.pop(step, time.monotonic())
        nbytes = sum(saved.values())
        self.written.append(step)
        self.emit(ev.CheckpointWritten(step, str(final), nbytes, seconds))
        log.info("checkpoint of step %d written to %s (%.1f MB, %.2fs)", step, final, nbytes / 1e6, seconds)
        self._prune(step)

    def _prune(self, newest: int) -> None:
        """Keeps the newest `keep` checkpoints (and 'final'); removes staging directories
        of steps the newest checkpoint supersedes."""
        steps = []
        for d in self.root.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and not d.is_symlink():
                steps.append(int(m.group(1)))
            elif d.name.startswith(".step-") and d.name.endswith(".partial"):
                m = _STEP_DIR.match(d.name[1:-len(".partial")])
                if m and int(m.group(1)) < newest and int(m.group(1)) not in self._saved:
                    shutil.rmtree(d, ignore_errors=True)
        keep = set(sorted(steps)[-self.keep:]) | {newest}
        final = self.root / "final"
        if final.is_symlink():
            m = _STEP_DIR.match(os.readlink(final))
            if m:
                keep.add(int(m.group(1)))
        for step in steps:
            if step not in keep:
                shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)

    def _check_space(self, step: int) -> None:
        """Refuses to start a checkpoint the disk cannot hold (judged by the size of the
        last one), so a full disk is reported before anything is written."""
        previous = latest_checkpoint(self.root.parent)
        if previous is None:
            return
        need = sum(f.stat().st_size for f in previous.path.rglob("*") if f.is_file())
        free = shutil.disk_usage(self.root).free
        if free < need * 1.1:
            raise self._failed(step, f"{free / 2**20:.1f} MiB free, the last checkpoint took {need / 2**20:.1f} MiB: "
                                     f"free at least {(need * 1.1 - free) / 2**20:.1f} MiB on the disk holding "
                                     f"{self.root.parent} (earlier runs, or keep fewer checkpoints with "
                                     "run.keep_checkpoints)")

    def _failed(self, step: int, why: str) -> CheckpointError:
        previous = latest_checkpoint(self.root.parent) if self.root.exists() else None
        kept = (f"the checkpoint of step {previous.step} ({previous.path}) is intact; after fixing this, "
                f"`flexmarl run --resume {self.root.parent}` continues from it") if previous else \
            "no earlier checkpoint exists"
        return CheckpointError(f"the checkpoint of step {step} could not be written: {why}; {kept}")
