"""The GPU transports between real processes (gpu-marked: skipped without CUDA): an NCCL
group's communicator made once and reused by the next publication, byte-exact each time,
between two GPUs; CUDA IPC between two processes on one GPU, received in place into a
model's own tensors. Their CPU-side logic runs everywhere in test_param_nccl."""

import json
import os
import subprocess
import sys

import msgspec
import pytest
import torch

from flexmarl.runtime.params.channel import Location, ParamChannel, ParamHandle

pytestmark = pytest.mark.gpu

GROUP_PUBLISHER = r"""
import json, sys, torch, msgspec
from flexmarl.runtime.params.channel import ParamChannel
transport, group = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
state = {"w": torch.randn(256, 128, device="cuda:0"), "b": torch.arange(1000, device="cuda:0", dtype=torch.int32),
         "h": torch.randn(7, device="cuda:0").to(torch.bfloat16)}
channel = ParamChannel()
def publish(version):
    handle = channel.publish(state, agent="planner", version=version, transport=transport, receivers=1, group=group)
    digests = {k: v.cpu().view(torch.uint8).flatten().tolist()[:64] + [float(v.float().sum())] for k, v in state.items()}
    print(json.dumps({"handle": msgspec.msgpack.encode(handle).hex(), "digests": digests}), flush=True)
    return handle
last = publish(1)
for line in sys.stdin:
    if line.strip() == "next":
        for t in state.values():
            t.add_(1)
        channel.release(last)
        last = publish(last.version + 1)
    elif line.strip() == "close":
        channel.close()
        print(json.dumps("closed"), flush=True)
        break
"""


def digests_of(tensors):
    return {k: v.cpu().view(torch.uint8).flatten().tolist()[:64] + [float(v.float().sum())] for k, v in tensors.items()}


@pytest.fixture
def publisher():
    procs = []

    def start(transport, group=""):
        proc = subprocess.Popen([sys.executable, "-c", GROUP_PUBLISHER, transport, group], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        procs.append(proc)
        return proc

    yield start
    for proc in procs:  # only the processes started here, by their handles
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def read(proc):
    line = proc.stdout.readline()
    assert line, f"publisher exited with {proc.wait(10)}"
    message = json.loads(line)
    return msgspec.msgpack.decode(bytes.fromhex(message["handle"]), type=ParamHandle), message["digests"]


def ask(proc, command):
    proc.stdin.write(command + "\n")
    proc.stdin.flush()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (NCCL refuses two ranks on one GPU)")
def test_an_nccl_group_is_joined_once_and_carries_two_publications_byte_exactly(publisher):
    pytest.importorskip("cupy")
    proc = publisher("nccl", "planner/test-1")
    first, want = read(proc)
    assert (first.nccl.group, first.nccl.world_size) == ("planner/test-1", 2)
    with ParamChannel(location=Location.here("cuda:1")) as receiver:
        got = receiver.receive(first, rank=1)
        assert all(t.device == torch.device("cuda:1") for t in got.values())
        assert digests_of(got) == want
        ask(proc, "next")
        second, want = read(proc)
        assert second.nccl == first.nccl  # the same communicator, not a new unique id
        got = receiver.receive(second, rank=1)
        assert digests_of(got) == want
        comms = receiver._transports["nccl"].communicators
        assert comms.groups() == {"planner": ("planner/test-1", 1)}
    ask(proc, "close")
    assert proc.wait(60) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_between_two_processes_on_one_gpu_lands_byte_exactly_in_a_models_own_tensors(publisher):
    proc = publisher("cuda_ipc")
    handle, want = read(proc)
    model = {"w": torch.zeros(256, 128, device="cuda:0"), "b": torch.zeros(1000, device="cuda:0", dtype=torch.int32),
             "h": torch.zeros(7, device="cuda:0", dtype=torch.bfloat16)}
    pointers = {k: v.data_ptr() for k, v in model.items()}
    with ParamChannel(location=Location.here("cuda:0")) as receiver:
        receiver.receive_into(handle, model)
        assert digests_of(model) == want
        assert {k: v.data_ptr() for k, v in model.items()} == pointers  # in place: no new tensors
    ask(proc, "close")
    assert proc.wait(60) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_released_cuda_ipc_allocation_is_reused_by_the_next_publication_and_freed_at_close():
    pytest.importorskip("cupy")
    nbytes = 256 * 2**20
    state = {"w": torch.ones(nbytes // 4, device="cuda:0")}
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(0)[0]
    with ParamChannel(location=Location.here("cuda:0")) as channel:
        first = channel.publish(state, agent="planner", version=1, transport="cuda_ipc")
        channel.release(first)  # no receiver ever opened it: kept for the next one
        second = channel.publish(state, agent="planner", version=2, transport="cuda_ipc")
        assert second.cuda_ipc.allocation == first.cuda_ipc.allocation and second.key != first.key
        torch.cuda.synchronize()
        held = free_before - torch.cuda.mem_get_info(0)[0]
    torch.cuda.synchronize()
    freed = torch.cuda.mem_get_info(0)[0] - (free_before - held)
    # One bucket for both publications; the driver hands memory out in 2 MiB pages.
    assert nbytes <= held < 2 * nbytes and freed >= nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_receiver_keeps_a_cuda_ipc_mapping_across_syncs_and_unmaps_it_at_close(publisher):
    pytest.importorskip("cupy")
    proc = publisher("cuda_ipc")
    handle, want = read(proc)
    with ParamChannel(location=Location.here("cuda:0")) as receiver:
        mappings = receiver._transport("cuda_ipc", ValueError).mappings
        got = receiver.receive(handle)
        assert digests_of(got) == want and mappings.opened == 1
        del got
        receiver.release(handle)
        again = receiver.receive(handle)  # the same allocation: nothing mapped again
        assert digests_of(again) == want and mappings.opened == 1 and len(mappings) == 1
        del again
    assert len(mappings) == 0  # unmapped at close
    ask(proc, "close")
    assert proc.wait(60) == 0


def test_a_receiver_maps_each_allocation_once_and_unmaps_the_least_recently_used_past_its_limit():
    from flexmarl.runtime.params.gpu import IpcMappings
    from flexmarl.runtime.params.types import CudaIpcInfo

    opened, closed = [], []

    class Mapping:  # what cudaIpcOpenMemHandle / cudaIpcCloseMemHandle would do, recorded
        def __init__(self, info):
            self.info = info
            opened.append(info.allocation)

        def close(self):
            closed.append(self.info.allocation)

    mappings = IpcMappings(2, Mapping)
    a, b, c = (CudaIpcInfo(0, bytes([i]) * 64, 1024, allocation=name) for i, name in enumerate("abc"))
    assert mappings.get(a) is mappings.get(a)  # a later sync from the same allocation maps nothing
    mappings.get(b), mappings.get(a), mappings.get(c)  # b is then the least recently used
    assert opened == ["a", "b", "c"] and closed == ["b"] and len(mappings) == 2
    mappings.close()
    assert sorted(closed) == ["a", "b", "c"] and mappings.opened == 3
