"""NCCL broadcast for the parameter channel's "nccl" transport (gpu.py), via CuPy.

A communicator joins an agent's trainer (rank 0) to the agent's rollout instances (ranks
1..n). It is made once per group, named by the handle's `NcclInfo.group`, and reused for
every later publication to the same group: NCCL's setup (a bootstrap over TCP between all
ranks) costs far more than a broadcast of a small model. The controller names the group
and assigns the ranks; the publisher creates the unique id (NCCL's bootstrap root runs in
the process that creates it) and it reaches the receivers inside the handle. A handle with
no group name gets a one-shot communicator, torn down after its broadcast.

Every end keeps at most one communicator per agent (`Communicators`): a new group for an
agent (its instances or its trainer changed) replaces the old one. A broadcast that fails
or times out drops its communicator, whose state is then unknown; the next publication
must come with a new group.

CuPy is imported only when a communicator is made, so CPU-only installs never load it.
This module does not know who the receivers are or how ranks are assigned.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from .bucket import ALIGN
from .types import NcclInfo, ParamHandle, ParamTransferError, describe

__all__ = ["Broadcast", "Communicators", "CupyCommunicator", "new_unique_id", "receive"]

log = logging.getLogger(__name__)


class CupyCommunicator:
    """One member of an NCCL communicator on one CUDA device. Construction blocks until
    every rank has joined (ncclCommInitRank)."""

    def __init__(self, info: NcclInfo, rank: int, device: torch.device):
        import cupy
        from cupy.cuda import nccl

        self.device = device
        with cupy.cuda.Device(device.index):
            self._comm = _init_rank(nccl, info, rank)
        self._uint8 = nccl.NCCL_UINT8

    def broadcast(self, bucket: torch.Tensor) -> None:
        """Rank 0 sends `bucket`; every other rank receives into its own `bucket`."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)  # off the compute stream the worker uses
            stream.wait_stream(torch.cuda.current_stream(self.device))
            self._comm.broadcast(bucket.data_ptr(), bucket.data_ptr(), bucket.numel(), self._uint8, 0,
                                 stream.cuda_stream)
            stream.synchronize()

    def close(self) -> None:
        self._comm.destroy()

    def abort(self) -> None:
        """ncclCommAbort: ends a broadcast stuck inside this communicator (its kernel stops
        spinning, its caller returns with an error) and frees the communicator."""
        self._comm.abort()


def _init_rank(nccl, info: NcclInfo, rank: int):
    """ncclCommInitRank through CuPy, which takes the unique id as bytes (CuPy 13 and
    later) or, before, as a tuple of C chars (signed on x86, unsigned on ARM)."""
    forms = (bytes(info.unique_id), tuple(b - 256 if b > 127 else b for b in info.unique_id), tuple(info.unique_id))
    for form in forms[:-1]:
        try:
            return nccl.NcclCommunicator(info.world_size, form, rank)
        except (TypeError, OverflowError):  # refused before any NCCL call: the argument's type
            continue
    return nccl.NcclCommunicator(info.world_size, forms[-1], rank)


class _Member:
    def __init__(self, info: NcclInfo, rank: int, comm):
        self.info, self.rank, self.comm = info, rank, comm
        self.lock = threading.Lock()  # one broadcast at a time on a communicator


class Communicators:
    """The communicators one end of the channel belongs to: at most one per agent, found
    by group name. `connect(info, rank, device)` makes a member (CupyCommunicator; tests
    pass a fake). Thread-safe: broadcasts run on threads of their own."""

    def __init__(self, connect: Callable[[NcclInfo, int, torch.device], object] = CupyCommunicator):
        self._connect = connect
        self._by_agent: dict[str, _Member] = {}
        self._lock = threading.Lock()

    def member(self, agent: str, info: NcclInfo, rank: int, device: torch.device) -> _Member:
        """This end's member of the handle's group, made (blocking until all ranks join)
        unless this end already belongs to that very group at that rank."""
        with self._lock:
            old = self._by_agent.get(agent) if info.group else None  # a one-shot leaves the group alone
            if old is not None and (old.info, old.rank) == (info, rank):
                return old
            if old is not None:
                del self._by_agent[agent]
        if old is not None:
            _close(old)  # the agent's previous group (its members changed)
        member = _Member(info, rank, self._connect(info, rank, device))
        if info.group:
            with self._lock:
                self._by_agent[agent] = member
        return member

    def done(self, agent: str, member: _Member, ok: bool) -> None:
        """After a broadcast: a one-shot or failed communicator is torn down."""
        if ok and member.info.group:
            return
        with self._lock:
            if self._by_agent.get(agent) is member:
                del self._by_agent[agent]
        if ok:
            _close(member)
        # A failed one is left alone: its peers may still be blocked in it, and closing
        # it from here could block too. Its device memory is lost until the process ends.

    def abort(self, agent: str, member: _Member) -> None:
        """Ends a broadcast stuck in `member` (called from another thread than the one
        inside it): the communicator is aborted and never used again."""
        with self._lock:
            if self._by_agent.get(agent) is member:
                del self._by_agent[agent]
        try:
            member.comm.abort()
        except Exception as exc:  # an abort that fails leaves only a leak behind
            log.warning("could not abort NCCL communicator %s: %r", member.info.group or "(one-shot)", exc)

    def groups(self) -> dict[str, tuple[str, int]]:
        """agent -> (group name, rank) of every communicator held."""
        with self._lock:
            return {a: (m.info.group, m.rank) for a, m in self._by_agent.items()}

    def close(self) -> None:
        with self._lock:
            members, self._by_agent = list(self._by_agent.values()), {}
        for member in members:
            _close(member)


def _close(member: _Member) -> None:
    name = member.info.group or "(one-shot)"
    # A broadcast still inside it is stuck (its caller timed out): waiting for it would
    # block this thread too, so such a communicator is left behind, a leak until exit.
    if not member.lock.acquire(timeout=1.0):
        log.warning("NCCL communicator %s is still in a broadcast; left as it is", name)
        return
    try:
        member.comm.close()
    except Exception as exc:  # a communicator that cannot be destroyed is only a leak
        log.warning("could not destroy NCCL communicator %s: %r", name, exc)
    finally:
        member.lock.release()


def group_of(handle: ParamHandle) -> NcclInfo:
    """The NCCL group a handle names (every nccl handle carries one)."""
    if handle.nccl is None:
        raise ParamTransferError(f"{describe(handle)}: malformed handle (no NCCL group)")
    return handle.nccl


def broadcast(comms: Communicators, handle: ParamHandle, rank: int, bucket: torch.Tensor) -> None:
    """Joins the handle's group at `rank` (if not a member yet) and broadcasts `bucket`."""
    member = comms.member(handle.agent, group_of(handle), rank, bucket.device)
    _broadcast(comms, handle, member, bucket)


def _broadcast(comms: Communicators, handle: ParamHandle, member: _Member, bucket: torch.Tensor) -> None:
    ok = False
    try:
        with member.lock:
            member.comm.broadcast(bucket)
        ok = True
    finally:
        comms.done(handle.agent, member, ok)


def receive(comms: Communicators, handle: ParamHandle, rank: int | None, device: torch.device,
            timeout_s: float, setup_timeout_s: float,
            cancelled: Callable[[], bool] = lambda: False) -> torch.Tensor:
    """The handle's bucket (uint8, total_bytes long) on `device`, not yet verified.

    Two waits: for the group to form (every rank joined: in async mode instances drain at
    different times, so the first may wait long for the last) up to `setup_timeout_s`,
    then for the broadcast itself up to `timeout_s`. The bucket is allocated only once
    the group has formed, so a receive that never starts holds no GPU memory; one that
    times out in the broadcast aborts its communicator, which stops the kernel and frees
    the bucket. `cancelled()` (polled) ends either wait at once: another rank died, so the
    group will never form or the broadcast never finish."""
    group = group_of(handle)
    world = group.world_size
    if rank is None or not 1 <= rank < world:
        raise ValueError(f"nccl receive needs rank= in 1..{world - 1} (the publisher is rank 0), got {rank}")
    joined, done = threading.Event(), threading.Event()
    state: dict[str, Any] = {}  # "member", then "bucket" or "error"

    def join_and_receive() -> None:
        try:
            member = comms.member(handle.agent, group, rank, device)
            state["member"] = member
            joined.set()
            bucket = torch.empty(max(handle.total_bytes, ALIGN), dtype=torch.uint8, device=device)
            _broadcast(comms, handle, member, bucket)
            state["bucket"] = bucket
        except BaseException as exc:  # reported below
            state["error"] = exc
        finally:
            joined.set()
            done.set()

    threading.Thread(target=join_and_receive, name=f"nccl-recv-{handle.key}", daemon=True).start()
    # CuPy cannot cancel ncclCommInitRank: on a set-up timeout or a cancel the thread stays
    # blocked until its peers appear (it holds no bucket).
    if not _wait(joined, setup_timeout_s, cancelled):
        why = "was cancelled (another rank died)" if cancelled() else f"did not form within {setup_timeout_s:.0f} s"
        raise ParamTransferError(f"{describe(handle)}: the NCCL group {why} (rank {rank} of {world}); "
                                 "the publisher or another receiver never joined")
    if not _wait(done, timeout_s, cancelled):
        comms.abort(handle.agent, state["member"])
        done.wait(timeout_s)  # the aborted broadcast returns, and its bucket goes with it
        why = "was cancelled (another rank died)" if cancelled() else f"did not complete within {timeout_s:.0f} s"
        raise ParamTransferError(f"{describe(handle)}: the NCCL broadcast {why} after the group formed "
                                 f"(rank {rank} of {world}); its communicator was aborted")
    if "error" in state:
        error = state["error"]
        raise ParamTransferError(f"{describe(handle)}: NCCL broadcast failed: {error!r}") from error
    return state["bucket"][: handle.total_bytes]


def _wait(event: threading.Event, timeout_s: float, cancelled: Callable[[], bool], poll_s: float = 0.05) -> bool:
    """Whether `event` was set within `timeout_s`; False at once if `cancelled()`."""
    deadline = time.monotonic() + timeout_s
    while not event.wait(min(poll_s, max(0.0, deadline - time.monotonic()))):
        if cancelled() or time.monotonic() >= deadline:
            return False
    return True


def new_unique_id() -> bytes:
    from cupy.cuda import nccl

    return bytes(b & 0xFF for b in nccl.get_unique_id())


class Broadcast:
    """Rank 0's side of one publication: joins the group and sends from a thread of its
    own, so publish() returns while the receivers are still being told to join."""

    def __init__(self, comms: Communicators, handle: ParamHandle, bucket: torch.Tensor):
        self.bucket, self._comms, self._handle = bucket, comms, handle
        self.error: BaseException | None = None
        self._member: _Member | None = None
        self._thread = threading.Thread(target=self._run, name=f"nccl-send-{handle.key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._member = self._comms.member(self._handle.agent, group_of(self._handle), 0, self.bucket.device)
            _broadcast(self._comms, self._handle, self._member, self.bucket)
        except BaseException as exc:
            self.error = exc
            log.error("%s: NCCL broadcast from rank 0 failed: %r", describe(self._handle), exc)

    def close(self, timeout_s: float = 5.0) -> None:
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            return
        if self._member is not None:  # stuck in the broadcast: a receiver is gone
            self._comms.abort(self._handle.agent, self._member)
            self._thread.join(timeout_s)
        else:
            log.warning("released an nccl publication whose receivers never all joined; its sender "
                        "thread stays blocked in ncclCommInitRank (CuPy cannot cancel it)")
