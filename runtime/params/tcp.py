"""The "tcp" transport: other hosts, CPU memory, over ZeroMQ. The publisher packs its
tensors into a host bucket and serves it in chunks from a server thread; each receiver
pulls the chunks into a host buffer with credit-based flow control, then verifies it.

Anything but loopback must be authenticated (CURVE): the publisher's public key travels
in the handle. A receiver's buffer backs the tensors it hands out until the receiver
releases the handle; then it is reused for the next transfer of the same size.

This module does not know who receives or when a publication ends: the channel's caller
decides.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import numpy as np
import zmq

from .bucket import pack_into
from .transport import Transport
from .types import ParamChannelConfig, ParamHandle, ParamTransferError, describe

__all__ = ["TcpTransport"]

log = logging.getLogger(__name__)


class _ChunkRequest(msgspec.Struct, array_like=True):
    """Receiver -> publisher's tcp server: send me bytes [offset, offset + size) of `key`."""

    key: str
    offset: int
    size: int


class _ChunkReply(msgspec.Struct, array_like=True):
    """Publisher's tcp server -> receiver; the chunk's bytes follow in the next frame."""

    key: str
    offset: int
    error: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(_ChunkRequest).decode
_decode_reply = msgspec.msgpack.Decoder(_ChunkReply).decode


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class _TcpServer:
    """Serves published buckets in chunks from one ROUTER socket on a thread of its own.
    Receivers pull with credit-based flow control (ZeroMQ guide, chapter 7): each asks for
    at most tcp_window chunks at a time, so neither end queues more than that."""

    def __init__(self, ctx: zmq.Context, config: ParamChannelConfig):
        self._ctx, self._config = ctx, config
        self._buckets: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._stop, self._ready = threading.Event(), threading.Event()
        self.endpoint = ""
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="param-tcp-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the parameter channel's tcp server failed: {self.error!r}") from self.error
        if not self._thread.is_alive():
            raise RuntimeError("the parameter channel's tcp server is not running")

    def add(self, key: str, bucket: np.ndarray) -> None:
        with self._lock:
            self._buckets[key] = bucket

    def remove(self, key: str) -> None:
        with self._lock:
            self._buckets.pop(key, None)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("parameter tcp server did not stop within %.1f s", timeout_s)

    def _run(self) -> None:
        try:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.linger = 0
            sock.maxmsgsize = 64 << 10  # requests are tiny; a peer sending more is disconnected
            if self._config.curve_secret_key:
                sock.curve_server = True
                sock.curve_secretkey = self._config.curve_secret_key.encode()
            port = sock.bind_to_random_port(f"tcp://{self._config.tcp_bind_host}")
            self.endpoint = f"tcp://{self._config.tcp_advertise_host or self._config.tcp_bind_host}:{port}"
        except BaseException as exc:  # reported to the caller by check()
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self._answer(sock, sock.recv_multipart())
        except BaseException as exc:
            self.error = exc
            log.exception("parameter tcp server stopped")
        finally:
            sock.close(linger=0)

    def _answer(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        try:
            req = _decode_request(body[0]) if len(body) == 1 else None
        except msgspec.DecodeError:
            req = None
        if req is None:
            log.warning("parameter tcp server: dropped a malformed request")
            sock.send_multipart([ident, _encode(_ChunkReply("", 0, "malformed request")), b""])
            return
        with self._lock:
            bucket = self._buckets.get(req.key)
        if bucket is None:
            error = f"no publication {req.key!r} here: it was released, or never published by this worker"
        elif req.offset < 0 or req.size <= 0 or req.offset + req.size > len(bucket):
            error = f"chunk [{req.offset}, {req.offset + req.size}) is outside the {len(bucket)}-byte bucket"
        else:
            chunk = bucket[req.offset : req.offset + req.size].data  # a memoryview: no copy
            sock.send_multipart([ident, _encode(_ChunkReply(req.key, req.offset)), chunk], copy=False)
            return
        sock.send_multipart([ident, _encode(_ChunkReply(req.key, req.offset, error)), b""])


def _tcp_pull(ctx: zmq.Context, handle: ParamHandle, dest: np.ndarray, config: ParamChannelConfig) -> None:
    """Fill `dest` with the handle's bucket, chunk by chunk, or raise ParamTransferError."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if handle.server_key:
        sock.curve_serverkey = handle.server_key.encode()
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(handle.endpoint)
    total, chunk, received, next_offset = handle.total_bytes, config.tcp_chunk_bytes, 0, 0
    pending: dict[int, int] = {}  # offset -> size of every chunk asked for, not yet here
    try:
        while received < total:
            while len(pending) < config.tcp_window and next_offset < total:
                size = min(chunk, total - next_offset)
                sock.send(_encode(_ChunkRequest(handle.key, next_offset, size)))
                pending[next_offset] = size
                next_offset += size
            if not sock.poll(int(config.timeout_s * 1000)):
                raise ParamTransferError(
                    f"{describe(handle)}: no data from {handle.endpoint} for {config.timeout_s:g} s after "
                    f"{received} of {total} bytes; the publisher died or is unreachable. Ask for a fresh publish.")
            frames = sock.recv_multipart(copy=False)
            try:
                reply = _decode_reply(frames[0].bytes) if len(frames) == 2 else None
            except msgspec.DecodeError:
                reply = None
            if reply is None:
                raise ParamTransferError(f"{describe(handle)}: malformed reply from {handle.endpoint}")
            if reply.error:
                raise ParamTransferError(f"{describe(handle)}: {handle.endpoint} refused: {reply.error}")
            asked = pending.pop(reply.offset, None) if reply.key == handle.key else None
            data = frames[1].buffer
            if asked is None or len(data) != asked:
                raise ParamTransferError(
                    f"{describe(handle)}: size mismatch: got {len(data)} bytes at offset {reply.offset}, "
                    f"expected {asked if asked is not None else 'no chunk there'}. Ask for a fresh publish.")
            dest[reply.offset : reply.offset + asked] = np.frombuffer(data, dtype=np.uint8)
            received += asked
    finally:
        sock.close(linger=0)


class TcpTransport(Transport):
    def __init__(self, config, location, host, *args) -> None:
        super().__init__(config, location, host, *args)
        self._ctx: zmq.Context | None = None
        self._server: _TcpServer | None = None

    @classmethod
    def check_config(cls, config):
        if not _is_loopback(config.tcp_bind_host) and not (config.curve_public_key and config.curve_secret_key):
            raise ValueError(f"refusing to serve parameters on {config.tcp_bind_host} without authentication: "
                             f"set curve_public_key and curve_secret_key (zmq.curve_keypair()) or bind 127.0.0.1")

    def publish(self, tensors, fields, *, bucket=None, path=None, receivers=1, group=""):
        buf = self.host.take(fields["total_bytes"])
        fields["checksum"] = pack_into(buf, tensors, fields["layout"])
        server = self._serving()
        handle = ParamHandle(**fields, endpoint=server.endpoint, server_key=self.config.curve_public_key)
        server.add(handle.key, buf.numpy())
        return handle, buf

    def receive(self, handle, *, verify, rank):
        return self.staged(handle, verify, lambda staging: _tcp_pull(self._context(), handle, staging.numpy(), self.config))

    def release(self, handle, resource):
        self._server.remove(handle.key)
        self.host.give(resource)

    def close(self):
        if self._server is not None:
            self._server.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    def _context(self) -> zmq.Context:
        self._ctx = self._ctx or zmq.Context()
        return self._ctx

    def _serving(self) -> _TcpServer:
        if self._server is None:
            self._server = _TcpServer(self._context(), self.config)
        self._server.check()
        return self._server
