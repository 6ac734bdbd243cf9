"""`flexmarl worker`: one worker process (rollout, trainer or env) connected to a controller."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from flexmarl.runtime import collector
from flexmarl.runtime.aio import limit_threads, run_async, setup_logging
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.params.shm_segments import remove_abandoned_segments, remove_orphan_engine_dirs
from flexmarl.runtime.params.types import ParamChannelConfig
from flexmarl.runtime.parent_watch import watch_parent

from .channel_config import channel_config
from .session import CommandHandler, WorkerSession

log = logging.getLogger("flexmarl.worker")


def make_handler(role: str, group_size: int = 1, threads: int = 1,
                 channel: ParamChannelConfig | None = None) -> CommandHandler:
    # Imported lazily: a trainer never needs vLLM, and neither needs the other's deps.
    if role == "rollout":
        from .rollout.worker import RolloutHandler
        return RolloutHandler(channel)
    if role == "trainer" and group_size > 1:
        from .trainer.group import TrainerGroupHandler
        return TrainerGroupHandler.start(group_size, threads, channel)  # this process is rank 0
    if role == "trainer":
        from .trainer.worker import TrainerHandler
        return TrainerHandler(channel)
    if role == "env":
        from .env.worker import EnvHandler
        return EnvHandler()
    raise SystemExit(f"unknown role {role!r}; use --role rollout, trainer or env")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, choices=["rollout", "trainer", "env"],
                        help="rollout: an inference engine; trainer: training states; env: the workflow's "
                             "tool, environment and reward functions")
    parser.add_argument("--connect", required=True, metavar="ADDR",
                        help="the controller's address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--worker-id", default="", help="unique name (default: role-host-pid)")
    parser.add_argument("--handshake-timeout", type=float, default=30.0,
                        help="seconds to wait for the controller's WELCOME (which sets the heartbeat)")
    parser.add_argument("--reconnect-timeout", type=float, default=TransportConfig.reconnect_timeout_s,
                        help="seconds to keep trying to register again when the controller goes away "
                             "(it may be restarted on the same address); 0: exit at once")
    parser.add_argument("--curve-dir", default="", help="CURVE keys (needed for non-loopback controllers)")
    parser.add_argument("--param-host", default="", metavar="ADDR",
                        help="address to serve parameters to other hosts on (default: the one facing the controller)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=1,
                        help="trainer only: processes that train each agent together (FSDP2), one GPU each; "
                             "this process is rank 0 and starts the others")
    parser.add_argument("--parent-pid", type=int, default=0, metavar="PID",
                        help="exit when this process (the one that started the worker) is gone")
    parser.add_argument("--log-level", default="INFO")


def run_worker(args: argparse.Namespace) -> int:
    if args.parent_pid:
        watch_parent(args.parent_pid)
    limit_threads(args.threads)
    collector.own_heap()  # an engine's start sets its heap apart from the collector (collector.building)
    setup_logging(args.log_level, name=args.worker_id or f"{args.role}:{os.getpid()}")
    removed = remove_abandoned_segments(ParamChannelConfig().shm_dir)
    if args.role == "rollout":
        removed += remove_orphan_engine_dirs()
    if removed:  # what processes that crashed on this host left, that no one may use any more
        log.info("removed %d shared-memory files left by crashed workers", len(removed))
    cfg = TransportConfig(address=args.connect, handshake_timeout_s=args.handshake_timeout,
                          reconnect_timeout_s=args.reconnect_timeout, curve_dir=args.curve_dir)

    async def main() -> int:
        # Before the session: a trainer group's ranks must all have joined first.
        channel = channel_config(args.connect, args.param_host)
        handler = make_handler(args.role, args.group_size, args.threads, channel)
        devices: list[str] = ["cpu"]
        pinned: list[str] = []
        if args.role != "env":  # an environment worker never loads torch
            from .precision import visible_devices  # torch: imported by a worker, not by every command's parser

            devices, pinned = visible_devices()
        session = WorkerSession(cfg, args.connect, handler, worker_id=args.worker_id, devices=devices,
                                visible_gpus=pinned,
                                new_handler=lambda: make_handler(args.role, args.group_size, args.threads, channel))
        task = asyncio.current_task()
        assert task is not None  # called from a coroutine
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # An orderly exit: the session's finally-block closes the socket and engine.
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await session.run()
        except asyncio.CancelledError:
            log.info("worker %s stopped by signal", session.worker_id)
            return 0

    return run_async(main)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flexmarl worker")
    add_arguments(parser)
    sys.exit(run_worker(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
