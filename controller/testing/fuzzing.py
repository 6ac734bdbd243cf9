"""Hostile input for the control plane: reproducible frames every receiver must reject.

`FrameFuzzer(seed, max_message_bytes)` makes multipart messages (lists of bytes), each
named by the case that made it. The cases are tables, one per kind of sender:

- MALFORMED: frames no receiver may accept, whoever sends them (random bytes, truncated
  or mutated bodies, every kind byte with garbage, wrong structs, oversized, too many
  frames, empty frames, kind and body in two frames). Each candidate is checked against
  the decoder and the transport's caps and remade if it happens to be a well-formed message.
- BEFORE_HELLO: well-formed messages an unregistered peer may not send the controller
  (HELLO with a wrong version or a bad role or id, any other kind before HELLO).
- REGISTERED: well-formed messages a registered worker may not send (a second HELLO,
  replies to requests nobody made, kinds only the controller sends).

The raw peers that deliver them are here too, on plain blocking sockets of their own
context so they can flood from a thread: `ControllerFlood` (two peers of the controller
that never read) and `FakeController` (a ROUTER a worker connects to, which floods it and
probes it with Echo). This module knows the protocol, not the controller's or the
worker's state; the bench (fuzz.py) and the tests wire it to them. It is test equipment,
not part of the runtime package.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Iterator

import msgspec
import zmq

from flexmarl.runtime import protocol
from flexmarl.runtime.transport import MAX_BUFFERS

Frames = list[bytes]
_encode = msgspec.msgpack.encode


def _body(msg: protocol.Message) -> bytes:
    """`msg`'s body alone (its first frame after the kind byte)."""
    return bytes(protocol.encode_one(msg)[1:])

_WITH_REQUEST_ID = [cls for cls in protocol.MESSAGE_TYPES.values()
                    if "request_id" in cls.__struct_fields__ and cls is not protocol.Hello]
# Only the controller sends these and they carry no request id. Heartbeat and Bye are
# left out: a registered worker may send them.
_CONTROLLER_ONLY: list[type[protocol.Message]] = [protocol.Welcome, protocol.Reject, protocol.Shutdown]


class FrameFuzzer:
    def __init__(self, seed: int, max_message_bytes: int) -> None:
        self.rng = random.Random(seed)
        self.limit = max_message_bytes

    # ------------------------------------------------------------ building blocks

    def blob(self, longest: int = 256) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, longest))

    def text(self, longest: int = 12) -> str:
        return "".join(self.rng.choice("abcdefgh-_/0123456789") for _ in range(self.rng.randint(1, longest)))

    def value(self, t: Any, depth: int = 0) -> Any:
        """A random value of msgspec type `t` (so the message it goes into is well formed)."""
        r = self.rng
        build: dict[type, Callable[[], Any]] = {
            msgspec.inspect.IntType: lambda: r.choice([0, 1, -1, r.randint(-2**31, 2**31), 2**63 - 1]),
            msgspec.inspect.FloatType: lambda: r.choice([0.0, 1.5, -1e300, float("inf"), r.random()]),
            msgspec.inspect.StrType: self.text,
            msgspec.inspect.BytesType: lambda: self.blob(32),
            msgspec.inspect.BoolType: lambda: r.random() < 0.5,
            msgspec.inspect.LiteralType: lambda: r.choice(t.values),
            msgspec.inspect.ListType: lambda: [self.value(t.item_type, depth + 1)
                                               for _ in range(r.randint(0, 3 if depth < 2 else 0))],
            msgspec.inspect.VarTupleType: lambda: tuple(self.value(t.item_type, depth + 1)
                                                        for _ in range(r.randint(0, 3 if depth < 2 else 0))),
            msgspec.inspect.DictType: lambda: {self.text(): self.value(t.value_type, depth + 1)
                                               for _ in range(r.randint(0, 3))},
            msgspec.inspect.StructType: lambda: t.cls(**{f.name: self.value(f.type, depth + 1) for f in t.fields}),
            msgspec.inspect.UnionType: lambda: self.value(r.choice(t.types), depth + 1),
            msgspec.inspect.NoneType: lambda: None,
            msgspec.inspect.AnyType: lambda: None,
        }
        return build[type(t)]()

    def message(self, cls: type[protocol.Message], **fields: Any) -> protocol.Message:
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        values = {f.name: self.value(f.type) for f in info.fields}
        values.update(fields)
        return cls(**values)

    def any_message(self, exclude: tuple[type, ...] = ()) -> protocol.Message:
        kinds = [c for c in protocol.MESSAGE_TYPES.values() if c not in exclude]
        return self.message(self.rng.choice(kinds))

    def is_rejected_by_any_receiver(self, frames: Frames) -> bool:
        if len(frames) > 1 + MAX_BUFFERS or protocol.frames_nbytes(frames) > self.limit:
            return True
        try:
            protocol.decode(frames)
        except protocol.ProtocolError:
            return True
        return False

    # ------------------------------------------------------------ malformed: any receiver

    def random_frames(self) -> Frames:
        return [self.blob(self.rng.choice([8, 64, 4096])) for _ in range(self.rng.randint(1, 4))]

    def empty_frames(self) -> Frames:
        return [b""] * self.rng.randint(1, 6)

    def kind_only(self) -> Frames:
        return [bytes([self.rng.randrange(256)])]

    def split_kind(self) -> Frames:
        """Kind and body in two frames, as an older peer sends them."""
        frame = protocol.encode_one(self.any_message())
        return [bytes(frame[:1]), bytes(frame[1:])]

    def unknown_kind(self) -> Frames:
        kind = self.rng.choice([k for k in range(256) if k not in protocol.MESSAGE_TYPES])
        return [bytes([kind]) + _body(self.any_message())]

    def garbage_body(self) -> Frames:
        return [bytes([self.rng.choice(list(protocol.MESSAGE_TYPES))]) + self.blob(self.rng.choice([4, 64, 1024]))]

    def truncated_body(self) -> Frames:
        frame = protocol.encode_one(self.any_message())
        return [bytes(frame[:1 + self.rng.randrange(len(frame) - 1)])]

    def mutated_body(self) -> Frames:
        frame = protocol.encode_one(self.any_message())
        kind, body = bytes(frame[:1]), bytearray(frame[1:])
        for _ in range(self.rng.randint(1, 4)):
            at = self.rng.randrange(len(body) + 1)
            op = self.rng.choice(("flip", "insert", "delete"))
            if op == "insert":
                body[at:at] = self.rng.randbytes(self.rng.randint(1, 3))
            elif body and at < len(body):
                if op == "flip":
                    body[at] = self.rng.randrange(256)
                else:
                    del body[at]
        return [kind + bytes(body)]

    def wrong_struct(self) -> Frames:
        kind = self.rng.choice(list(protocol.MESSAGE_TYPES))
        other = self.any_message(exclude=(protocol.MESSAGE_TYPES[kind],))
        return [bytes([kind]) + _body(other)]

    def wrong_field_type(self) -> Frames:
        msg = self.any_message()
        fields = list(msgspec.structs.astuple(msg))
        at = self.rng.randrange(len(fields))
        fields[at] = self.rng.choice(["text", 3.5, -7, None, [1, "x"], {"k": b"v"}, True, b"\x00"])
        return [bytes([int(msg.KIND)]) + _encode(fields)]

    def extra_fields(self) -> Frames:
        msg = self.any_message()
        fields = list(msgspec.structs.astuple(msg)) + [self.rng.randint(0, 9)] * self.rng.randint(1, 3)
        return [bytes([int(msg.KIND)]) + _encode(fields)]

    def oversized_body(self) -> Frames:
        # Up to twice the cap: above it, but under libzmq's own 4x cutoff (a silent disconnect).
        size = self.rng.randint(self.limit + 1, 2 * self.limit)
        return [bytes([protocol.Kind.ECHO]) + _encode(protocol.Echo(1, bytes(size)))]

    def oversized_buffers(self) -> Frames:
        n = self.rng.randint(2, 8)
        return protocol.encode(protocol.Echo(1), [bytes(self.limit // n + 1)] * n)

    def too_many_frames(self) -> Frames:
        n = self.rng.choice([MAX_BUFFERS + 1, 1000, 10_000])
        return protocol.encode(protocol.Echo(1), [b""] * n)

    # ------------------------------------------------------------ well formed, unwelcome

    def wrong_version_hello(self) -> Frames:
        version = self.rng.choice([0, -1, protocol.PROTOCOL_VERSION + 1, 2**40, self.rng.randint(-99, 99)])
        version = version if version != protocol.PROTOCOL_VERSION else 0
        return protocol.encode(self.message(protocol.Hello, protocol_version=version, role="trainer"))

    def bad_hello(self) -> Frames:
        fields = self.rng.choice([{"role": self.rng.choice(["", "admin", "ROLLOUT", self.text()])},
                                  {"role": "rollout", "worker_id": ""},
                                  # Longer than a worker id may be, shorter than the frames libzmq
                                  # itself drops unseen (MAXMSGSIZE, 4x the limit): each is answered.
                                  {"role": "trainer", "worker_id": "w" * self.rng.randint(129, 3 * self.limit)}])
        return protocol.encode(self.message(protocol.Hello, protocol_version=protocol.PROTOCOL_VERSION, **fields))

    def before_hello(self) -> Frames:
        return protocol.encode(self.any_message(exclude=(protocol.Hello,)))

    def duplicate_hello(self) -> Frames:
        return protocol.encode(self.message(protocol.Hello, protocol_version=protocol.PROTOCOL_VERSION,
                                            role="rollout", worker_id=f"dup-{self.text()}"))

    def unknown_request(self) -> Frames:
        # Request ids the controller hands out count up from 1; these are far above.
        cls = self.rng.choice(_WITH_REQUEST_ID)
        return protocol.encode(self.message(cls, request_id=self.rng.randint(2**40, 2**62)))

    def controller_only_kind(self) -> Frames:
        return protocol.encode(self.message(self.rng.choice(_CONTROLLER_ONLY)))


# name -> (generator, weight). Weights keep the costly oversized cases rare.
MALFORMED: dict[str, tuple[Callable[[FrameFuzzer], Frames], int]] = {
    "random bytes": (FrameFuzzer.random_frames, 10),
    "empty frames": (FrameFuzzer.empty_frames, 3),
    "kind frame only": (FrameFuzzer.kind_only, 3),
    "kind and body split": (FrameFuzzer.split_kind, 3),
    "unknown kind": (FrameFuzzer.unknown_kind, 4),
    "garbage body": (FrameFuzzer.garbage_body, 10),
    "truncated body": (FrameFuzzer.truncated_body, 8),
    "mutated body": (FrameFuzzer.mutated_body, 8),
    "wrong struct": (FrameFuzzer.wrong_struct, 6),
    "wrong field type": (FrameFuzzer.wrong_field_type, 6),
    "extra fields": (FrameFuzzer.extra_fields, 3),
    "oversized body": (FrameFuzzer.oversized_body, 1),
    "oversized buffers": (FrameFuzzer.oversized_buffers, 1),
    "too many frames": (FrameFuzzer.too_many_frames, 1),
}
BEFORE_HELLO = {
    "wrong version HELLO": (FrameFuzzer.wrong_version_hello, 4),
    "bad HELLO": (FrameFuzzer.bad_hello, 2),
    "kind before HELLO": (FrameFuzzer.before_hello, 4),
}
REGISTERED = {
    "duplicate HELLO": (FrameFuzzer.duplicate_hello, 3),
    "reply to unknown request": (FrameFuzzer.unknown_request, 6),
    "controller-only kind": (FrameFuzzer.controller_only_kind, 2),
}


def _pick(fuzzer: FrameFuzzer, table: dict) -> tuple[str, Frames]:
    names = list(table)
    name = fuzzer.rng.choices(names, weights=[table[n][1] for n in names])[0]
    return name, table[name][0](fuzzer)


def malformed(fuzzer: FrameFuzzer) -> tuple[str, Frames]:
    for _ in range(20):
        name, frames = _pick(fuzzer, MALFORMED)
        if fuzzer.is_rejected_by_any_receiver(frames):
            return name, frames
    return "unknown kind", [b"\x00\x90"]  # kind 0 is never assigned


def controller_plan(seed: int, n: int, max_message_bytes: int) -> Iterator[tuple[str, str, Frames]]:
    """(peer, case, frames) for the controller: peer "stranger" never sent HELLO, peer
    "intruder" registered first. Half the frames are malformed, split between the two."""
    fuzzer = FrameFuzzer(seed, max_message_bytes)
    for _ in range(n):
        roll = fuzzer.rng.random()
        if roll < 0.5:
            yield (fuzzer.rng.choice(("stranger", "intruder")), *malformed(fuzzer))
        elif roll < 0.75:
            yield ("stranger", *_pick(fuzzer, BEFORE_HELLO))
        else:
            yield ("intruder", *_pick(fuzzer, REGISTERED))


def worker_plan(seed: int, n: int, max_message_bytes: int) -> Iterator[tuple[str, Frames]]:
    """(case, frames) for a worker: everything malformed (a well-formed message from its
    controller is a command, and executing it is the worker's job)."""
    fuzzer = FrameFuzzer(seed, max_message_bytes)
    for _ in range(n):
        yield malformed(fuzzer)


# ---------------------------------------------------------------- raw peers


def _recv(sock: zmq.Socket, timeout_s: float) -> list[bytes]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no message within {timeout_s}s")
    return sock.recv_multipart()


class HostileDealer:
    """A DEALER to the controller that sends whatever it is given and never reads (so the
    controller's queue to it fills up). `register()` makes it a registered worker first."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def register(self, worker_id: str, timeout_s: float = 5.0) -> None:
        self.sock.send_multipart(protocol.encode(protocol.Hello(
            protocol.PROTOCOL_VERSION, worker_id, "rollout", "fuzz", 0)))
        reply, _ = protocol.decode(_recv(self.sock, timeout_s))
        if not isinstance(reply, protocol.Welcome):
            raise RuntimeError(f"the controller did not welcome {worker_id}: {reply}")

    def send(self, frames: Frames) -> None:
        self.sock.send_multipart(frames)  # blocks at the high-water mark: nothing is dropped

    def close(self) -> None:
        self.sock.close(linger=0)


class FakeController:
    """A ROUTER a worker connects to: it welcomes the worker, then floods it and probes it
    with Echo round trips. Everything the worker sends back is read (and mostly ignored)."""

    def __init__(self, ctx: zmq.Context, heartbeat_interval_s: float, heartbeat_timeout_s: float) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # block at the high-water mark, never drop
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.heartbeat = (heartbeat_interval_s, heartbeat_timeout_s)
        self.worker = b""
        self.heartbeats = 0  # heartbeats the worker sent while we waited for echoes
        self._rid = 0

    def welcome(self, timeout_s: float = 10.0) -> None:
        identity, *frames = _recv(self.sock, timeout_s)
        hello, _ = protocol.decode(frames)
        if not isinstance(hello, protocol.Hello):
            raise RuntimeError(f"expected HELLO, got {hello}")
        self.worker = identity
        self.send(protocol.encode(protocol.Welcome(protocol.PROTOCOL_VERSION, *self.heartbeat)))

    def send(self, frames: Frames) -> None:
        self.sock.send_multipart([self.worker, *frames])

    def echo(self, timeout_s: float) -> float:
        """Seconds for one Echo round trip; raises TimeoutError past `timeout_s`."""
        self._rid += 1
        started = time.perf_counter()
        self.send(protocol.encode(protocol.Echo(self._rid, b"probe")))
        while True:
            left = timeout_s - (time.perf_counter() - started)
            _, *frames = _recv(self.sock, max(left, 0.001))
            reply, _ = protocol.decode(frames)
            if isinstance(reply, protocol.Heartbeat):
                self.heartbeats += 1
            elif isinstance(reply, protocol.EchoReply) and reply.request_id == self._rid:
                return time.perf_counter() - started

    def close(self) -> None:
        self.sock.close(linger=0)


# ---------------------------------------------------------------- floods (run in a thread)


class ControllerFlood:
    """Two hostile peers of the controller at `address`: a stranger that never sends a
    valid HELLO and an intruder that registers first. Neither reads. They stay connected
    until `close()`, so frames still queued when `run` returns are delivered, not lost."""

    def __init__(self, address: str, intruder_id: str = "fuzz-intruder") -> None:
        self.ctx = zmq.Context()
        self.intruder_id = intruder_id
        self.peers = {"stranger": HostileDealer(self.ctx, address, f"{intruder_id}/stranger".encode()),
                      "intruder": HostileDealer(self.ctx, address, intruder_id.encode())}

    def run(self, plan: Iterator[tuple[str, str, Frames]]) -> dict[str, int]:
        """Sends every frame of `plan` as fast as the sockets take them; counts by case."""
        self.peers["intruder"].register(self.intruder_id)
        sent: dict[str, int] = {}
        for peer, case, frames in plan:
            self.peers[peer].send(frames)
            sent[case] = sent.get(case, 0) + 1
        return sent

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.ctx.term()


def flood_worker(fake: FakeController, plan: Iterator[tuple[str, Frames]], probe_every_s: float,
                 probe_timeout_s: float) -> tuple[dict[str, int], list[float]]:
    """Welcomes the worker, sends it every frame of `plan` and, every `probe_every_s`, an
    Echo it must answer within `probe_timeout_s`; returns counts by case and the probes'
    round-trip seconds (the last one after the whole flood)."""
    fake.welcome()
    sent: dict[str, int] = {}
    latencies: list[float] = []
    next_probe = time.monotonic()
    for case, frames in plan:
        fake.send(frames)
        sent[case] = sent.get(case, 0) + 1
        if time.monotonic() >= next_probe:
            latencies.append(fake.echo(probe_timeout_s))
            next_probe = time.monotonic() + probe_every_s
    latencies.append(fake.echo(probe_timeout_s))
    return sent, latencies
