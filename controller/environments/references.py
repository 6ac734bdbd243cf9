"""What travels to an environment worker for one call: the function by reference, its
arguments in the wire's own encoding (msgpack).

`reference(fn)` is (module, qualified name), the name by which an environment worker
finds the same function in the same module (the workflow's file is imported there under
the name it has here). Only a function, class or static method reachable by that name
qualifies: a lambda, a function defined inside another, a bound method or a function of
`__main__` is refused with what to do instead. `encode_arguments` packs the call's
arguments and names the first one msgpack cannot carry; results decode with `decode`.

It knows nothing about workers or routing.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable

import msgspec

_encode = msgspec.msgpack.Encoder().encode
SENDABLE = "None, bool, int, float, str, bytes, and lists, tuples and dicts of them"

_known: dict[Any, tuple[str, str]] = {}  # functions already checked


class NotSendable(TypeError):
    """A call cannot travel to an environment worker: its function or an argument."""


def describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def reference(fn: Callable[..., Any]) -> tuple[str, str]:
    """(module, qualified name) of `fn`, checked to name `fn` itself; NotSendable otherwise."""
    try:
        known = _known.get(fn)
    except TypeError:  # not hashable: not a function either
        known = None
    if known is not None:
        return known
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    what = f"ctx.call({describe(fn)}, ...)"
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, (type, ModuleType)):
        raise NotSendable(f"{what}: a bound method cannot be sent to an environment worker (its object stays here); "
                          f"call a module-level function, or keep the object in a session (ctx.env_session)")
    if not module or not name or "<" in name:
        raise NotSendable(f"{what}: an environment worker runs functions by reference (module and name); "
                          f"{describe(fn)} is a lambda or is defined inside a function: define it at the top "
                          f"level of a module")
    if module == "__main__":
        raise NotSendable(f"{what}: {name} is defined in __main__, which an environment worker cannot import; "
                          f"move it to the workflow's module or one it imports")
    if _resolve(module, name) != fn:  # a classmethod is a new bound method at each access, equal to the last
        raise NotSendable(f"{what}: {module}.{name} does not name this function (it was replaced or wrapped); "
                          f"pass the function that module defines")
    _known[fn] = (module, name)
    return module, name


def label(module: str, name: str) -> str:
    """How messages name a function: `flow.py:score` for one of a file imported by path
    (the workflow's), `pkg.module.score` otherwise."""
    loaded = sys.modules.get(module)
    path = getattr(loaded, "__file__", None) or ""
    if module.startswith("flexmarl_") and path:
        return f"{path.rsplit('/', 1)[-1]}:{name}"
    return f"{module}.{name}"


def _resolve(module: str, name: str) -> Any:
    try:
        obj: Any = sys.modules.get(module) or importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def encode_arguments(what: str, args: tuple, kwargs: dict[str, Any]) -> bytes:
    """msgpack of [args, kwargs] of a call of `what`; NotSendable naming the first argument
    that cannot go."""
    try:
        return _encode([args, kwargs])
    except (TypeError, OverflowError):
        pass
    for where, value in [*((f"argument {i + 1}", a) for i, a in enumerate(args)),
                         *((f"argument {k}=", v) for k, v in kwargs.items())]:
        try:
            _encode(value)
        except (TypeError, OverflowError) as exc:
            raise NotSendable(f"{what}: {where} (a {type(value).__name__}) cannot be sent to "
                              f"an environment worker ({exc}); pass {SENDABLE} (a sample's text or "
                              f"list(sample.output_ids), say)") from None
    raise NotSendable(f"{what}: its arguments cannot be sent to an environment worker; "
                      f"pass {SENDABLE}")


def decode(value: bytes) -> Any:
    return msgspec.msgpack.decode(value)
