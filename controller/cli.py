"""The `flexmarl` command line.

    flexmarl run [CONFIG] [--mode sync|async] [--max-staleness K] [--steps N] [--seed S] [--out DIR]
                 [--launcher local|ray]
    flexmarl run --resume RUN_DIR [--resume-from step-N] [--steps N] [--resume-anyway]
    flexmarl controller --config CONFIG [--bind ADDR]
    flexmarl worker --role rollout|trainer|env --connect ADDR
    flexmarl replay RUN_DIR/events.log [--trace FILE.json] [--plot FILE.png] [--check]
    flexmarl samples RUN_DIR [--step N] [--agent NAME]
    flexmarl serve RUN_DIR|CHECKPOINT [--host H] [--port P]
    flexmarl view RUN_DIR [--host H] [--port P]
    flexmarl keys DIR

`run` puts everything on this host (workers are child processes), or with `--launcher ray`
starts the workers as actors on a Ray cluster; `controller` and `worker` are the pieces
for several hosts. Any config key can be overridden with
``--set section.key=value``. `--resume RUN_DIR` continues a run from its newest intact
checkpoint (or the one `--resume-from` names), with the config it was started with (plus
any overrides given).
"""

# (Not in the docstring above, which is `flexmarl --help`.) Each command imports what it
# runs when it runs (the event loop, the config, the worker package): `replay`,
# `samples` and `view` start in a fraction of the time `run` needs.

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexmarl.runtime.config import ExperimentConfig

log = logging.getLogger("flexmarl")


def _overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.set or [])
    for flag, key in (("mode", "pipeline.mode"), ("max_staleness", "pipeline.max_staleness"),
                      ("steps", "run.steps"), ("seed", "run.seed"), ("out", "run.out"),
                      ("bind", "transport.address"), ("launcher", "cluster.launcher")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    if getattr(args, "no_progress", False):
        overrides.append("run.progress=false")
    return overrides


def _config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    from flexmarl.runtime.config import load_config

    from .tasks.digit_chain import default_config

    overrides = _overrides(args)
    defaults = default_config()
    if args.config is not None:
        # A config file is a whole job: its [agents] are the agents, never added to the
        # embedded default's (the file may still leave other keys to the defaults).
        del defaults["agents"]
    return load_config(args.config, overrides, defaults=defaults)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["sync", "async"])
    p.add_argument("--max-staleness", type=int, metavar="K")
    p.add_argument("--steps", type=int, metavar="N")
    p.add_argument("--seed", type=int, metavar="S")
    p.add_argument("--out", metavar="DIR")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error in the config, "
                   "workflow, data or models (by default: one line)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its newest intact checkpoint")
    p.add_argument("--resume-from", metavar="step-N", type=_checkpoint_step,
                   help="with --resume: continue from the checkpoint of step N instead")
    p.add_argument("--resume-anyway", action="store_true",
                   help="with --resume: go on although run.seed, pipeline.queries_per_step or the data changed")


def _checkpoint_step(text: str) -> int:
    """'step-N', 'step-00000N' or 'N' -> N."""
    digits = text.removeprefix("step-")
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} names no checkpoint: give step-N (a directory under "
                                         "RUN_DIR/checkpoints) or N")
    return int(digits)


def _experiment(args: argparse.Namespace, spawn_workers: bool):
    from flexmarl.runtime.config import ConfigError

    from .run.experiment import Experiment

    if args.resume:
        if args.config is not None:
            raise ConfigError("--resume continues a run with the config in its directory; "
                              "give no CONFIG (use --set to change a key)")
        return Experiment.resuming(args.resume, overrides=_overrides(args), spawn_workers=spawn_workers,
                                   anyway=args.resume_anyway, step=args.resume_from)
    if args.resume_from is not None:
        raise ConfigError("--resume-from chooses the checkpoint of a --resume; give --resume RUN_DIR too")
    return Experiment(_config_from_args(args), spawn_workers=spawn_workers)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors in what the user wrote or brought (config, workflow, data, models, a run that
    cannot learn), and failures the run cannot mend (a worker that keeps dying): shown as
    their message alone; `--debug` adds the traceback."""
    from flexmarl.runtime.config import ConfigError
    from flexmarl.runtime.eventlog import EventLogError

    from .episodes.data import DataError
    from .episodes.user_code import WorkflowError
    from .launch.launcher import LaunchError, WorkerFailed
    from .run.model_resolution import ModelBuildError, ModelError
    from .state.failures import RunFailed
    from .train.checkpoints import CheckpointError

    return (ConfigError, CheckpointError, WorkflowError, DataError, ModelError, ModelBuildError, RunFailed,
            LaunchError, WorkerFailed, EventLogError)


def _stop_line(exc: BaseException, run_dir: Any, known: tuple[type[BaseException], ...]) -> str | None:
    """The one line an error that stopped the run is shown as: a full disk anywhere says
    what to free and how to go on; a known error (also as a supervised task's cause) its
    message. None: an error FlexMARL does not expect (a bug), shown with its traceback."""
    from .run.disk_full import chain, disk_full_line

    line = disk_full_line(exc, run_dir)
    if line is not None:
        return line
    return next((str(e) for e in chain(exc) if isinstance(e, known)), None)


def _report(exc: BaseException, debug: bool, line: str | None = None) -> None:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"flexmarl: {line or exc}", file=sys.stderr)


def _resume_hint(run_dir: Any) -> str:
    from .train.checkpoints import latest_checkpoint

    point = latest_checkpoint(run_dir)
    return (f"`flexmarl run --resume {run_dir}` continues from the checkpoint of step {point.step}" if point
            else "no checkpoint was written yet")


def _cancel_on_signals() -> None:
    """Ctrl-C and SIGTERM cancel the running task, which shuts its workers down in order."""
    import asyncio
    import signal

    task = asyncio.current_task()
    assert task is not None  # called from a coroutine
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)


def _train(make_experiment, debug: bool = False) -> int:
    import asyncio

    from flexmarl.runtime.aio import run_async

    user_errors = _user_errors()

    async def main() -> int:
        _cancel_on_signals()
        try:
            experiment = make_experiment()
        except user_errors as exc:
            _report(exc, debug)
            return 2
        try:
            async with experiment as exp:
                summary = await exp.train()
        except asyncio.CancelledError:
            print(f"flexmarl: interrupted: the workers were shut down; {_resume_hint(experiment.run_dir)}",
                  file=sys.stderr)
            return 130
        except Exception as exc:
            line = _stop_line(exc, experiment.run_dir, user_errors)
            if line is None:
                raise
            _report(exc, debug, line)
            return 1
        print(summary.report())
        return 0

    return run_async(main)


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from flexmarl.runtime.aio import run_async

    from .run.serve import ServedAgents

    overrides = list(args.set or []) + [f"openai.{key}={value!r}" if isinstance(value, str) else f"openai.{key}={value}"
                                        for key, value in (("host", args.host), ("port", args.port)) if value is not None]

    async def main() -> int:
        _cancel_on_signals()
        try:
            await ServedAgents(args.target, overrides).run()
        except _user_errors() as exc:
            _report(exc, args.debug)
            return 2
        except asyncio.CancelledError:
            return 0
        return 1  # the endpoint stopped on its own

    return run_async(main)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(worker_options="worker" in argv).parse_args(argv)
    COMMANDS[args.command](args)


def _parser(worker_options: bool = True) -> argparse.ArgumentParser:
    """The command line; `worker_options=False` leaves the worker command's options out
    (only `worker` reads them, and they live in the worker package)."""
    parser = argparse.ArgumentParser(prog="flexmarl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p_run = sub.add_parser("run", help="train on this host (controller and workers as child processes)")
    p_run.add_argument("config", nargs="?", help="TOML config (default: the embedded default job)")
    p_run.add_argument("--launcher", choices=["local", "ray"],
                       help="who starts the workers: child processes here (local), or actors on a Ray cluster (ray)")
    _add_run_options(p_run)

    p_ctl = sub.add_parser("controller", help="run only the controller; workers connect to it")
    p_ctl.add_argument("--config", help="TOML config")
    p_ctl.add_argument("--bind", metavar="ADDR", help="e.g. tcp://127.0.0.1:5555")
    _add_run_options(p_ctl)

    p_wrk = sub.add_parser("worker", help="run one worker process")
    if worker_options:
        from flexmarl.workers.main import add_arguments as add_worker_arguments
        add_worker_arguments(p_wrk)

    p_rep = sub.add_parser("replay", help="summarise, trace, plot or check a run's event log")
    p_rep.add_argument("log", metavar="RUN_DIR", help="a run directory, or its events.log")
    p_rep.add_argument("--trace", metavar="FILE.json")
    p_rep.add_argument("--plot", metavar="FILE.png")
    p_rep.add_argument("--check", action="store_true")

    p_smp = sub.add_parser("samples", help="print the sample texts a run recorded (run.samples_per_step)")
    p_smp.add_argument("run_dir", metavar="RUN_DIR")
    p_smp.add_argument("--step", type=int, help="only this step")
    p_smp.add_argument("--agent", help="only this agent")

    p_srv = sub.add_parser("serve", help="serve a run's trained agents behind its OpenAI-compatible API")
    p_srv.add_argument("target", metavar="RUN_DIR|CHECKPOINT", help="a run directory (its last checkpoint) or a checkpoint")
    p_srv.add_argument("--host", help="the address to listen on (default: openai.host, loopback)")
    p_srv.add_argument("--port", type=int, help="the port (default: openai.port; 0 picks a free one)")
    p_srv.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key")
    p_srv.add_argument("--log-level", default="INFO")
    p_srv.add_argument("--debug", action="store_true")

    p_view = sub.add_parser("view", help="serve a web page of a run, finished or running")
    p_view.add_argument("run_dir", metavar="RUN_DIR")
    p_view.add_argument("--host", help="the address to listen on (default: loopback; any other needs a key in "
                        "FLEXMARL_VIEW_KEY)")
    p_view.add_argument("--port", type=int, help="the port (default: 0, a free one; the address is printed)")

    p_keys = sub.add_parser("keys", help="create CURVE keys for non-loopback controllers")
    p_keys.add_argument("dir")

    return parser


def _run_worker(args: argparse.Namespace) -> None:
    from flexmarl.workers.main import run_worker
    sys.exit(run_worker(args))


def _create_keys(args: argparse.Namespace) -> None:
    from flexmarl.runtime.transport import create_curve_keys
    create_curve_keys(args.dir)
    print(f"CURVE keys written to {args.dir}; copy the folder to every host and set "
          f"transport.curve_dir (controller) and --curve-dir (workers)")


def _print_samples(args: argparse.Namespace) -> None:
    from .records.sample_log import format_samples, read_samples, selection_problem
    try:
        rows = read_samples(args.run_dir)
    except FileNotFoundError as exc:
        sys.exit(f"flexmarl: {exc}")
    problem = selection_problem(rows, args.step, args.agent)
    if problem is not None:
        sys.exit(f"flexmarl: {args.run_dir}: {problem}")
    sys.stdout.write(format_samples(rows, args.step, args.agent))


def _replay(args: argparse.Namespace) -> None:
    from .replay.command import main as replay_main
    sys.exit(replay_main(args))


def _serve_run(args: argparse.Namespace) -> None:
    from flexmarl.runtime.aio import limit_threads, setup_logging

    limit_threads(1)
    setup_logging(args.log_level, name="serve")
    sys.exit(_serve(args))


def _view(args: argparse.Namespace) -> None:
    from flexmarl.runtime.aio import run_async, setup_logging

    from .view.command import view

    setup_logging("WARNING", name="view")

    async def main() -> int:
        _cancel_on_signals()
        return await view(args.run_dir, args.host, args.port)

    sys.exit(run_async(main))


def _run_controller(args: argparse.Namespace) -> None:
    """`run` (the workers as child processes or Ray actors) and `controller` (workers
    connect to it)."""
    from flexmarl.runtime.aio import limit_threads, setup_logging
    from flexmarl.runtime.config import ConfigError

    limit_threads(1)
    setup_logging(args.log_level, name="controller")
    spawn = args.command == "run"
    if not args.resume:
        try:
            _config_from_args(args)  # a bad config fails here, before anything starts
        except ConfigError as exc:
            if args.debug:
                traceback.print_exc()
            sys.exit(f"flexmarl: bad configuration: {exc}")
    sys.exit(_train(lambda: _experiment(args, spawn), debug=args.debug))


# What each subcommand runs.
COMMANDS = {"run": _run_controller, "controller": _run_controller, "worker": _run_worker, "replay": _replay,
            "samples": _print_samples, "serve": _serve_run, "view": _view, "keys": _create_keys}


if __name__ == "__main__":
    main()
