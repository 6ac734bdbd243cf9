"""The nccl transport's communicators, with a stand-in for NCCL: one per agent and group,
made once and reused by every later publication to the group, replaced when the group
changes, torn down after a one-shot broadcast, dropped (never reused) after a failure.
The real broadcast runs in the gpu tests of test_param_channel."""

import threading

import msgspec
import pytest
import torch

from flexmarl.runtime.params import nccl as param_nccl
from flexmarl.runtime.params.channel import ParamChannelConfig
from flexmarl.runtime.params.gpu import NcclTransport
from flexmarl.runtime.params.transport import HostBuffers
from flexmarl.runtime.params.types import Location, NcclInfo, ParamHandle, ParamTransferError


class FakeComm:
    """Stands in for a CuPy NCCL communicator: counts what it was asked to do."""

    made: list["FakeComm"] = []

    def __init__(self, info, rank, device, fail=False):
        self.info, self.rank, self.device, self.fail = info, rank, device, fail
        self.broadcasts, self.closed = 0, False
        FakeComm.made.append(self)

    def broadcast(self, bucket):
        if self.fail:
            raise RuntimeError("NCCL error: remote process exited")
        self.broadcasts += 1

    def close(self):
        self.closed = True


@pytest.fixture
def comms():
    FakeComm.made = []
    return param_nccl.Communicators(FakeComm)


def handle(agent, info):
    return ParamHandle(transport="nccl", agent=agent, version=1, key=f"{agent}-{info.group}", layout=[],
                       total_bytes=0, checksum=0, publisher=Location("h", 1), nccl=info)


BUCKET = torch.zeros(8, dtype=torch.uint8)


def test_a_group_communicator_is_made_once_and_reused_by_every_later_broadcast(comms):
    info = NcclInfo(b"\x01" * 128, 3, "planner/1")
    for _ in range(3):
        param_nccl.broadcast(comms, handle("planner", info), 2, BUCKET)
    assert len(FakeComm.made) == 1 and FakeComm.made[0].broadcasts == 3 and FakeComm.made[0].rank == 2
    assert comms.groups() == {"planner": ("planner/1", 2)}


def test_a_new_group_for_an_agent_replaces_and_closes_its_old_communicator(comms):
    old, new = NcclInfo(b"\x01" * 128, 3, "planner/1"), NcclInfo(b"\x02" * 128, 2, "planner/2")
    param_nccl.broadcast(comms, handle("planner", old), 1, BUCKET)
    param_nccl.broadcast(comms, handle("solver", NcclInfo(b"\x03" * 128, 2, "solver/1")), 1, BUCKET)
    param_nccl.broadcast(comms, handle("planner", new), 1, BUCKET)
    first, solver, second = FakeComm.made
    assert first.closed and not solver.closed and not second.closed
    assert comms.groups() == {"planner": ("planner/2", 1), "solver": ("solver/1", 1)}
    comms.close()
    assert solver.closed and second.closed and comms.groups() == {}


def test_a_one_shot_broadcast_tears_its_communicator_down_and_leaves_the_group_alone(comms):
    group = NcclInfo(b"\x01" * 128, 3, "planner/1")
    param_nccl.broadcast(comms, handle("planner", group), 1, BUCKET)
    param_nccl.broadcast(comms, handle("planner", NcclInfo(b"\x09" * 128, 2)), 1, BUCKET)
    kept, one_shot = FakeComm.made
    assert one_shot.closed and one_shot.broadcasts == 1 and not kept.closed
    assert comms.groups() == {"planner": ("planner/1", 1)}


def test_a_failed_broadcast_drops_its_communicator_so_the_next_one_is_made_afresh():
    FakeComm.made = []
    failing = iter([True, False])
    comms = param_nccl.Communicators(lambda info, rank, device: FakeComm(info, rank, device, fail=next(failing)))
    info = NcclInfo(b"\x01" * 128, 2, "planner/1")
    with pytest.raises(RuntimeError, match="remote process exited"):
        param_nccl.broadcast(comms, handle("planner", info), 1, BUCKET)
    assert comms.groups() == {}
    param_nccl.broadcast(comms, handle("planner", info), 1, BUCKET)
    assert len(FakeComm.made) == 2 and FakeComm.made[1].broadcasts == 1


def test_the_same_group_at_another_rank_is_joined_afresh(comms):
    info = NcclInfo(b"\x01" * 128, 3, "planner/1")
    param_nccl.broadcast(comms, handle("planner", info), 1, BUCKET)
    param_nccl.broadcast(comms, handle("planner", info), 2, BUCKET)
    assert [c.rank for c in FakeComm.made] == [1, 2] and FakeComm.made[0].closed


def test_broadcasts_on_one_communicator_never_overlap(comms):
    info = NcclInfo(b"\x01" * 128, 2, "planner/1")
    inside, overlaps = threading.Semaphore(1), []

    class SlowComm(FakeComm):
        def broadcast(self, bucket):
            if not inside.acquire(blocking=False):
                overlaps.append(1)
            threading.Event().wait(0.01)
            inside.release()

    comms = param_nccl.Communicators(SlowComm)
    threads = [threading.Thread(target=param_nccl.broadcast, args=(comms, handle("planner", info), 1, BUCKET))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []


def test_a_receiver_must_be_given_a_rank_the_publisher_does_not_hold(comms):
    info = NcclInfo(b"\x01" * 128, 3, "planner/1")
    for rank in (None, 0, 3):
        with pytest.raises(ValueError, match=r"rank= in 1\.\.2"):
            param_nccl.receive(comms, handle("planner", info), rank, torch.device("cpu"), 1.0, 1.0)


def test_the_publisher_keeps_one_unique_id_per_group_and_makes_a_new_one_for_a_new_group():
    ids = iter(bytes([i]) * 128 for i in range(1, 10))
    transport = NcclTransport(ParamChannelConfig(), Location("h", 1), HostBuffers(0), new_unique_id=lambda: next(ids))
    first = transport.group_info("planner", "planner/1", receivers=2)
    assert first == NcclInfo(b"\x01" * 128, 3, "planner/1")
    assert transport.group_info("planner", "planner/1", receivers=2) is first  # same communicator
    assert transport.group_info("solver", "solver/1", receivers=1).unique_id == b"\x02" * 128
    replaced = transport.group_info("planner", "planner/2", receivers=1)
    assert (replaced.unique_id, replaced.world_size) == (b"\x03" * 128, 2)
    one_shots = [transport.group_info("planner", "", receivers=1) for _ in range(2)]
    assert one_shots[0].unique_id != one_shots[1].unique_id and one_shots[0].group == ""
    assert transport.group_info("planner", "planner/2", receivers=1) is replaced  # one-shots leave it alone
    with pytest.raises(ValueError, match="receivers >= 1"):
        transport.group_info("planner", "planner/3", receivers=0)


def test_replacing_a_communicator_stuck_in_a_broadcast_does_not_wait_for_it(comms):
    stuck = NcclInfo(b"\x01" * 128, 2, "planner/1")
    member = comms.member("planner", stuck, 1, BUCKET.device)
    member.lock.acquire()  # as if a broadcast hung inside it, its caller long timed out
    param_nccl.broadcast(comms, handle("planner", NcclInfo(b"\x02" * 128, 2, "planner/2")), 1, BUCKET)
    assert not FakeComm.made[0].closed and FakeComm.made[1].broadcasts == 1
    assert comms.groups() == {"planner": ("planner/2", 1)}


CPU = torch.device("cpu")  # the fakes broadcast nothing: a CPU bucket stands in for a GPU one


def test_a_receiver_waits_for_a_slow_group_to_form_beyond_the_broadcast_timeout():
    """In async mode an agent's instances drain at different times: the first to join
    waits for the last. That wait has its own, longer limit."""
    class SlowToForm(FakeComm):
        def __init__(self, *args):
            threading.Event().wait(0.5)  # the other ranks join late
            super().__init__(*args)

    comms = param_nccl.Communicators(SlowToForm)
    h = handle("planner", NcclInfo(b"\x01" * 128, 2, "planner/1"))
    h = msgspec.structs.replace(h, total_bytes=16)
    bucket = param_nccl.receive(comms, h, 1, CPU, timeout_s=0.1, setup_timeout_s=30.0)
    assert bucket.numel() == 16 and FakeComm.made[-1].broadcasts == 1


def never_forming():
    """Communicators whose set-up blocks (a rank never joins) until the event is set."""
    release = threading.Event()

    class NeverForms(FakeComm):
        def __init__(self, *args):
            release.wait(10)
            super().__init__(*args)

    return param_nccl.Communicators(NeverForms), release


def test_a_group_that_never_forms_fails_the_receive_after_the_set_up_wait_holding_no_bucket():
    allocated = []
    comms, release = never_forming()
    h = handle("planner", NcclInfo(b"\x01" * 128, 2, "planner/1"))
    real_empty = torch.empty
    try:
        torch.empty = lambda *a, **k: allocated.append(a) or real_empty(*a, **k)
        with pytest.raises(ParamTransferError, match="did not form within"):
            param_nccl.receive(comms, h, 1, CPU, timeout_s=0.05, setup_timeout_s=0.2)
        assert allocated == []  # nothing was allocated for a broadcast that never began
    finally:
        torch.empty = real_empty
        release.set()


def test_a_broadcast_that_hangs_is_aborted_its_thread_ends_and_its_communicator_is_dropped():
    class Hangs(FakeComm):
        def __init__(self, *args):
            super().__init__(*args)
            self.aborted = threading.Event()

        def broadcast(self, bucket):
            self.aborted.wait(10)  # a peer died mid-broadcast: the kernel spins until aborted
            raise RuntimeError("NCCL communicator was aborted")

        def abort(self):
            self.aborted.set()

    comms = param_nccl.Communicators(Hangs)
    h = handle("planner", NcclInfo(b"\x01" * 128, 2, "planner/1"))
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ParamTransferError, match="communicator was aborted"):
        param_nccl.receive(comms, h, 1, CPU, timeout_s=0.2, setup_timeout_s=5.0)
    # (an earlier test's set-up thread, released late, may have added its own since)
    comm = next(c for c in reversed(FakeComm.made) if isinstance(c, Hangs))
    assert comm.aborted.is_set() and comms.groups() == {}
    assert not [t for t in threading.enumerate() if t.name.startswith("nccl-recv") and t.name not in before]


@pytest.mark.parametrize("accepts", ["bytes", "signed", "unsigned"])
def test_the_unique_id_reaches_cupy_in_the_form_its_version_takes(accepts):
    """CuPy 13 and later take the id as bytes, older versions as C chars (signed on x86,
    unsigned on ARM); a wrong form is refused by the argument's type, before NCCL runs."""
    uid = bytes(range(120, 248))
    made = []

    class FakeNccl:
        @staticmethod
        def NcclCommunicator(world, comm_id, rank):
            kind = "bytes" if isinstance(comm_id, bytes) else "signed" if min(comm_id) < 0 else "unsigned"
            if kind != accepts:
                raise (OverflowError if kind == "signed" and accepts == "unsigned" else TypeError)(kind)
            made.append((world, comm_id, rank))
            return object()

    param_nccl._init_rank(FakeNccl, NcclInfo(uid, 3, "g"), 2)
    (world, comm_id, rank), = made
    assert (world, rank) == (3, 2) and bytes(b & 0xFF for b in comm_id) == uid


def test_a_cancelled_receive_gives_up_waiting_for_a_group_a_dead_rank_never_joins():
    comms, release = never_forming()
    h = handle("planner", NcclInfo(b"\x01" * 128, 3, "planner/1"))
    gone = threading.Event()
    threading.Timer(0.2, gone.set).start()  # another rank dies; the controller says so
    try:
        with pytest.raises(ParamTransferError, match="was cancelled"):
            param_nccl.receive(comms, h, 1, CPU, timeout_s=1.0, setup_timeout_s=60.0, cancelled=gone.is_set)
    finally:
        release.set()


def test_a_channels_cancel_names_one_publication_and_never_reaches_a_retry_of_the_same_version():
    from flexmarl.runtime.params.channel import ParamChannel

    with ParamChannel() as channel:
        first = channel.publish({"w": torch.ones(4)}, agent="planner", version=3, transport="shm")
        retry = channel.publish({"w": torch.ones(4)}, agent="planner", version=3, transport="shm")
        shm, asked = channel._transport("shm", ValueError), []
        receive = shm.receive

        def watched(handle, **kw):  # what a waiting transport (nccl) polls during the receive
            asked.append(shm.cancelled(handle.agent, handle.version))
            return receive(handle, **kw)

        shm.receive = watched
        channel.cancel(first.key)  # late: its receive is not under way
        channel.receive(retry)
        channel.receive(first)
        assert asked == [False, True]
        assert not shm.cancelled("planner", 3)  # the receive of `first` ended: the cancel is spent


def test_a_cuda_ipc_receiver_opens_the_memory_on_the_gpu_it_is_on_in_its_own_numbering():
    """The publisher's cuda:0 (pinned to the host's GPU 2) is a receiver's cuda:2, or an
    engine worker's cuda:1: the GPU is found by its UUID, not by the publisher's index."""
    from flexmarl.runtime.params.gpu import local_gpu
    from flexmarl.runtime.params.types import CudaIpcInfo, ParamTransferError

    info = CudaIpcInfo(0, b"h" * 64, 1024, uuid="GPU-c")
    assert local_gpu(info, ["GPU-a", "GPU-b", "GPU-c"]) == 2
    assert local_gpu(info, ["GPU-b", "GPU-c"]) == 1
    assert local_gpu(CudaIpcInfo(3, b"h" * 64, 1024), []) == 3  # no UUID: the index, as before
    with pytest.raises(ParamTransferError, match="GPU GPU-c, which this process does not see"):
        local_gpu(info, ["GPU-a"])


def test_a_cuda_ipc_receiver_makes_a_mappings_views_once_for_every_version_of_its_layout(monkeypatch):
    """Each sync after the first comes in the same allocation with the same layout: the
    views of the bucket are the ones made for the first (hundreds of views cost more than
    the bytes' copy on a GPU), and a new layout makes new ones. The mapping is a CPU
    tensor here, standing in for the publisher's GPU memory."""
    from flexmarl.runtime.params import gpu as param_gpu
    from flexmarl.runtime.params.bucket import pack_into, plan_layout
    from flexmarl.runtime.params.types import CudaIpcInfo

    monkeypatch.setattr(param_gpu, "_require_cuda", lambda handle: None)
    memory = torch.zeros(4096, dtype=torch.uint8)

    class Mapping:
        def __init__(self, info):
            self.tensor = memory

        def close(self):
            pass

    transport = param_gpu.CudaIpcTransport(ParamChannelConfig(), Location("h", 1), HostBuffers(0),
                                           open_mapping=Mapping)

    def publish(tensors, version):
        layout, total = plan_layout(tensors)
        checksum = pack_into(memory[:total], tensors, layout)
        return ParamHandle(transport="cuda_ipc", agent="a", version=version, key=f"a-{version}", layout=layout,
                           total_bytes=total, checksum=checksum, publisher=Location("h", 1),
                           cuda_ipc=CudaIpcInfo(0, bytes(64), 4096, allocation="one"))

    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int32)}
    first, _ = transport.receive(publish(state, 1), verify=True, rank=None)
    state = {k: v + 1 for k, v in state.items()}
    second, _ = transport.receive(publish(state, 2), verify=True, rank=None)
    assert all(second[k] is first[k] for k in state)  # the same views: nothing made again
    assert all(torch.equal(second[k], state[k]) for k in state)  # reading this version's bytes
    other = {"w": torch.ones(2, 2)}
    third, _ = transport.receive(publish(other, 3), verify=True, rank=None)
    assert set(third) == {"w"} and third["w"].shape == (2, 2) and torch.equal(third["w"], other["w"])
