"""One process of an environment worker's pool: runs the workflow's functions, one call at a time.

    python -m flexmarl.workers.env.process --fd FD --workflow SPEC [--memory-mb N] --parent-pid PID

The worker (pool.py) starts it with one end of a socket pair as file descriptor FD. It
imports the workflow's module (`run.workflow`: a file, imported under the same name the
controller gave it, so a function's `__module__` names it here too, or a dotted module),
answers with an `EnvResult` of call id 0 (failure "refused", with the error, when the
import failed), then reads `EnvCall`s and answers each with its `EnvResult`, in order,
until the socket closes. Frames are a 4-byte big-endian length and the msgpack struct.

A call names its function by module and qualified name; arguments and the value travel as
msgpack (the wire's own encoding): a value msgpack cannot carry fails the call
("unsendable"), never the process. A coroutine function's coroutine is run to its end
here. A session (op "open") keeps the object its function returned, and later calls of
that session are its methods; "close" calls its `close()` if it has one. A call that
raises fails with the exception in one line (and the frame of the user's code) and the
user's traceback; the process goes on. With `--memory-mb`, the process's address space is
limited (RLIMIT_AS): a runaway allocation raises MemoryError in the call that made it.

It knows nothing of the controller, the pool's scheduling or time limits: the pool kills
a process whose call ran out of time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import resource
import socket
import struct
import sys
import time
import traceback
from typing import Any, Callable

import msgspec

from flexmarl.runtime import protocol
from flexmarl.runtime.parent_watch import watch_parent
from flexmarl.runtime.tracebacks import user_frame, user_traceback
from flexmarl.runtime.user_modules import import_file

HEADER = struct.Struct(">I")  # a frame's length
READY = 0  # the call id of the process's first answer: the workflow's module imported, or why not

_calls = msgspec.msgpack.Decoder(protocol.EnvCall)
_encode = msgspec.msgpack.Encoder().encode


def load_workflow_module(spec: str) -> Any:
    """The module of `run.workflow` ("path/file.py:fn" or "pkg.module:fn"), imported as the
    controller imports it (a file under the name its path gives it, its folder on sys.path)."""
    where = spec.rsplit(":", 1)[0]
    if where.endswith(".py") or "/" in where:
        return import_file(where, "flexmarl_workflow")
    return importlib.import_module(where)


def resolve(module: str, name: str) -> Any:
    """The object `module`.`name` (a qualified name: `Env.step` walks attributes)."""
    obj: Any = sys.modules.get(module) or importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def one_line(exc: BaseException) -> str:
    where = user_frame(exc)
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {protocol.shorten(text, 300)}" + (f" (at {where})" if where else "")


class Runner:
    """Runs calls in this process; holds its sessions' objects."""

    def __init__(self) -> None:
        self.sessions: dict[str, Any] = {}
        self.functions: dict[tuple[str, str], Callable] = {}

    def run(self, call: protocol.EnvCall) -> protocol.EnvResult:
        started = time.monotonic()
        try:
            value = self._run(call)
        except Exception as exc:
            return protocol.EnvResult(call.call_id, failure="raised", error=one_line(exc),
                                      detail=user_traceback(exc), seconds=time.monotonic() - started)
        try:
            data = _encode(value)
        except (TypeError, OverflowError) as exc:
            return protocol.EnvResult(
                call.call_id, failure="unsendable", seconds=time.monotonic() - started,
                error=f"the value {call.name} returned (a {type(value).__name__}) cannot be sent back: {exc}; "
                      f"return msgpack values (None, bool, int, float, str, bytes, lists and dicts of them)")
        return protocol.EnvResult(call.call_id, data, seconds=time.monotonic() - started)

    def _run(self, call: protocol.EnvCall) -> Any:
        args, kwargs = msgspec.msgpack.decode(call.payload)
        if call.op == "close":
            obj = self.sessions.pop(call.session, None)
            close = getattr(obj, "close", None)
            return _finish(close()) if callable(close) else None
        if call.session and call.op == "call":
            if call.session not in self.sessions:
                raise LookupError(f"no session {call.session} in this process")
            return _finish(getattr(self.sessions[call.session], call.name)(*args, **kwargs))
        key = (call.module, call.name)
        fn = self.functions.get(key)
        if fn is None:
            fn = self.functions[key] = resolve(call.module, call.name)
        value = _finish(fn(*args, **kwargs))
        if call.op == "open":
            self.sessions[call.session] = value
            return None
        return value


def _finish(value: Any) -> Any:
    """A coroutine's (or other awaitable's) result, run to its end; anything else as is."""
    if inspect.isawaitable(value):
        async def wait() -> Any:
            return await value
        return asyncio.run(wait())
    return value


def send(channel: socket.socket, result: protocol.EnvResult) -> None:
    body = _encode(result)
    channel.sendall(HEADER.pack(len(body)) + body)


def receive(channel: socket.socket) -> protocol.EnvCall | None:
    """The next call, or None once the worker closed the channel."""
    head = _read_exactly(channel, HEADER.size)
    if head is None:
        return None
    body = _read_exactly(channel, HEADER.unpack(head)[0])
    return None if body is None else _calls.decode(body)


def _read_exactly(channel: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        block = channel.recv(n - len(data))
        if not block:
            return None
        data += block
    return bytes(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl.workers.env.process")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--workflow", required=True)
    parser.add_argument("--memory-mb", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=0)
    args = parser.parse_args(argv)
    if args.parent_pid:
        watch_parent(args.parent_pid, grace_s=1.0)
    channel = socket.socket(fileno=args.fd)
    try:
        load_workflow_module(args.workflow)
    except BaseException as exc:
        send(channel, protocol.EnvResult(READY, failure="refused", error=one_line(exc), detail=user_traceback(exc)))
        return 1
    if args.memory_mb:  # after the import: the limit is the calls', not the interpreter's start-up
        limit = args.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    send(channel, protocol.EnvResult(READY))
    runner = Runner()
    try:
        while (call := receive(channel)) is not None:
            send(channel, runner.run(call))
    except OSError:  # the worker closed the channel under a call: it is going, and so is this process
        pass
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
