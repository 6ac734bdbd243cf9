"""Tests for flexmarl.runtime.params.channel: every CPU transport moves a real model state
byte-exactly (in one process and between two real processes), damaged or cut-off
transfers raise ParamTransferError and leave the destination alone, and the GPU
transports run where a CUDA device exists."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import warnings

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmarl.runtime.params.channel import (
    CHECKSUM_BLOCK,
    TRANSPORTS,
    CudaIpcInfo,
    Location,
    NcclInfo,
    ParamChannel,
    ParamChannelConfig,
    ParamHandle,
    ParamTransferError,
    checksum,
    choose_transport,
    pack_into,
    plan_layout,
    read_handle,
    remove_orphan_segments,
)
from flexmarl.runtime.params.inproc import InprocTransport

torch.set_num_threads(1)
CPU_TRANSPORTS = ["inproc", "shm", "tcp", "disk"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --- helpers ----------------------------------------------------------------------------


def trained_state(seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A small Transformer's weights plus its Adam state after one step (0-dim `step`s)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested-tensor fast path notice
        model = torch.nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                     dim_feedforward=64, dropout=0.0, batch_first=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 5, 32), torch.randn(2, 4, 32)).pow(2).mean().backward()
    opt.step()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for idx, per_param in opt.state_dict()["state"].items():
        for k, v in per_param.items():
            state[f"optim.{idx}.{k}"] = v
    return {k: v.to(device) for k, v in state.items()}


def edge_case_tensors() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "fp16": torch.randn(7).half(),
        "int64": torch.arange(-3, 8, dtype=torch.int64),
        "int8_odd": torch.tensor([1, -2, 3], dtype=torch.int8),  # 3 bytes: padding after it
        "bool": torch.tensor([True, False, True]),
        "complex": torch.randn(2, 2, dtype=torch.complex64),
        "float64": torch.randn(3, dtype=torch.float64),
        "scalar": torch.tensor(2.5),
        "scalar_int": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty_3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "transposed": base.t(),
        "strided": base[:, ::2],
        "param": torch.nn.Parameter(torch.randn(4, 4)),
    }


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def digest(t: torch.Tensor) -> str:
    return f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(raw(t).numpy().tobytes()).hexdigest()


def assert_byte_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(raw(got[name]), raw(t)), name


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


@pytest.fixture
def shm_dir():
    path = tempfile.mkdtemp(prefix="flexmarl-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def config(shm_dir) -> ParamChannelConfig:
    return ParamChannelConfig(shm_dir=shm_dir, timeout_s=2.0, tcp_chunk_bytes=64 << 10, disk_fsync=False)


@pytest.fixture
def channels(config):
    opened = []

    def make(**overrides) -> ParamChannel:
        channel = ParamChannel(msgspec.structs.replace(config, **overrides))
        opened.append(channel)
        return channel

    yield make
    for channel in opened:
        channel.close()


@pytest.fixture
def processes():
    """Child processes started by a test; stopped by PID at teardown, nothing else."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


PUBLISHER_SCRIPT = r"""
import importlib.util, json, sys, torch, msgspec
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("param_tests", sys.argv[1])
tests = importlib.util.module_from_spec(spec); spec.loader.exec_module(tests)
from flexmarl.runtime.params.channel import ParamChannel, ParamChannelConfig
transport, shm_dir, device = sys.argv[2], sys.argv[3], sys.argv[4]
state = tests.trained_state(seed=1, device=device)
state.update({k: v.to(device) for k, v in tests.edge_case_tensors().items()})
channel = ParamChannel(ParamChannelConfig(shm_dir=shm_dir))
handle = channel.publish(state, agent="planner", version=1, transport=transport)
print(json.dumps({"handle": msgspec.msgpack.encode(handle).hex(),
                  "digests": {k: tests.digest(v) for k, v in state.items()}}), flush=True)
for line in sys.stdin:
    if line.strip() == "release":
        channel.release(handle)
    channel.close() if line.strip() == "close" else None
    print(json.dumps(line.strip()), flush=True)
    if line.strip() == "close":
        break
"""


def start_publisher(processes, transport: str, shm_dir: str, device: str = "cpu", script: str = PUBLISHER_SCRIPT):
    """Runs a publisher script; returns the process, the handle it published and digests."""
    proc = subprocess.Popen([sys.executable, "-c", script, __file__, transport, shm_dir, device],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    processes.append(proc)
    line = proc.stdout.readline()
    assert line, f"publisher exited with {proc.wait(10)}"
    message = json.loads(line)
    return proc, msgspec.msgpack.decode(bytes.fromhex(message["handle"]), type=ParamHandle), message["digests"]


def tell(proc: subprocess.Popen, command: str) -> None:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == command


# --- moving real model states -----------------------------------------------------------


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_each_cpu_transport_moves_a_model_state_byte_exactly(channels, transport, tmp_path):
    state = trained_state()
    publisher, receiver = channels(), channels()
    handle = publisher.publish(state, agent="planner", version=3, transport=transport, path=tmp_path / "s.params")
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=ParamHandle)
    assert wire == handle
    assert_byte_exact(receiver.receive(wire), state)


def test_shm_moves_a_model_state_byte_exactly_and_the_tensors_load_back(channels):
    state = trained_state()
    handle = channels().publish(state, agent="planner", version=1, transport="shm")
    got = channels().receive(handle)
    assert_byte_exact(got, state)
    model = torch.nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                 dim_feedforward=64, dropout=0.0, batch_first=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in got.items() if k.startswith("model.")})
    assert torch.equal(model.encoder.layers[0].linear1.weight, state["model.encoder.layers.0.linear1.weight"])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_model_state_moves_between_two_processes_byte_exactly(channels, processes, shm_dir, transport):
    proc, handle, digests = start_publisher(processes, transport, shm_dir)
    assert handle.publisher.pid == proc.pid
    receiver = channels()
    got = receiver.receive(handle)
    assert {k: digest(v) for k, v in got.items()} == digests
    if transport == "shm":
        assert os.path.exists(handle.path)
    del got
    receiver.release(handle)
    tell(proc, "release")
    with pytest.raises(ParamTransferError):
        receiver.receive(handle)
    tell(proc, "close")
    assert proc.wait(10) == 0
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_layout_edge_cases_survive_every_cpu_transport(channels, transport, tmp_path):
    tensors = edge_case_tensors()
    handle = channels().publish(tensors, agent="a", version=0, transport=transport, path=tmp_path / "e.params")
    assert all(spec.offset % 64 == 0 for spec in handle.layout)
    got = channels().receive(handle)
    assert_byte_exact(got, tensors)
    assert got["scalar"].dim() == 0 and got["empty_3d"].shape == (3, 0, 2)


def test_an_empty_tensor_set_round_trips(channels):
    for transport in CPU_TRANSPORTS[:3]:
        handle = channels().publish({}, agent="a", version=0, transport=transport)
        assert handle.total_bytes == 0 and channels().receive(handle) == {}


def test_inproc_hands_over_the_publishers_tensors_without_copying(channels):
    tensors = {"w": torch.randn(8, 8), "b": torch.randn(8)}
    channel = channels()
    got = channel.receive(channel.publish(tensors, agent="a", version=0, transport="inproc"))
    assert got["w"].data_ptr() == tensors["w"].data_ptr()


@pytest.mark.parametrize("transport", ["shm", "tcp", "disk"])
def test_received_tensors_are_views_into_one_bucket(channels, transport, tmp_path):
    handle = channels().publish(trained_state(), agent="a", version=0, transport=transport, path=tmp_path / "v.params")
    got = channels().receive(handle)
    storages = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(storages) == 1


def test_receive_into_materialises_into_tensors_on_any_device_layout(channels):
    state = trained_state()
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    handle = channels().publish(state, agent="a", version=0, transport="shm")
    channels().receive_into(handle, dst)
    assert_byte_exact(dst, state)


def test_receive_into_refuses_a_mismatched_destination_before_writing(channels):
    state = trained_state()
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    dst["model.decoder.norm.weight"] = torch.zeros(31)
    before = snapshot(dst)
    handle = channels().publish(state, agent="a", version=0, transport="shm")
    with pytest.raises(ValueError, match="decoder.norm.weight"):
        channels().receive_into(handle, dst)
    assert_byte_exact(dst, before)


def test_a_receivers_tcp_buffer_is_freed_on_release_and_reused_by_the_next_receive(channels):
    publisher, receiver = channels(), channels()
    for version in range(4):
        state = trained_state(seed=version)
        handle = publisher.publish(state, agent="a", version=version, transport="tcp")
        got = receiver.receive(handle)
        assert_byte_exact(got, state)
        assert receiver.held_receive_buffers() == 1  # behind `got`: the spare of the last sync, reused
        del got
        receiver.release(handle)
        publisher.release(handle)
        assert receiver.held_receive_buffers() == 1  # kept as a spare, not one per receive


# --- the transport table: the one place a transport is chosen ------------------------


def test_an_unknown_transport_is_refused_naming_every_known_one(channels):
    channel = channels()
    known = "expected one of inproc, shm, tcp, disk, cuda_ipc, nccl"
    with pytest.raises(ValueError, match=f"unknown transport 'pigeon'; {known}"):
        channel.publish({"w": torch.randn(4)}, agent="a", version=1, transport="pigeon")
    handle = channel.publish({"w": torch.randn(4)}, agent="a", version=1, transport="shm")
    with pytest.raises(ParamTransferError, match=f"unknown transport 'pigeon'; {known}"):
        channel.receive(msgspec.structs.replace(handle, transport="pigeon"))


def test_a_transport_added_to_the_table_serves_publish_receive_release_and_close(channels, monkeypatch):
    calls = []

    class Recording(InprocTransport):
        def publish(self, tensors, fields, **options):
            calls.append("publish")
            return super().publish(tensors, fields, **options)

        def receive(self, handle, *, verify, rank):
            calls.append("receive")
            return super().receive(handle, verify=verify, rank=rank)

        def release(self, handle, resource):
            calls.append("release")
            super().release(handle, resource)

        def close(self):
            calls.append("close")

    monkeypatch.setitem(TRANSPORTS, "recording", Recording)
    channel, tensors = channels(), {"w": torch.randn(4)}
    handle = channel.publish(tensors, agent="a", version=1, transport="recording")
    assert handle.transport == "recording"
    assert_byte_exact(channel.receive(handle), tensors)
    channel.release(handle)
    channel.close()
    assert calls == ["publish", "receive", "release", "close"]


# --- damage: the receiver raises and keeps what it had ---------------------------------


def loaded_receiver(channels, transport, tmp_path):
    """A receiver that already holds version 1 in `dst`, and the handle of version 2."""
    publisher, receiver = channels(), channels()
    v1, v2 = trained_state(seed=1), trained_state(seed=2)
    dst = {k: torch.zeros_like(v) for k, v in v1.items()}
    receiver.receive_into(publisher.publish(v1, agent="a", version=1, transport=transport, path=tmp_path / "1.params"), dst)
    assert_byte_exact(dst, v1)
    handle = publisher.publish(v2, agent="a", version=2, transport=transport, path=tmp_path / "2.params")
    return receiver, handle, dst, v1


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("transport", ["shm", "disk"])
def test_a_corrupted_bucket_raises_and_leaves_the_previous_tensors_untouched(channels, transport, tmp_path):
    receiver, handle, dst, v1 = loaded_receiver(channels, transport, tmp_path)
    flip_byte(handle.path, os.path.getsize(handle.path) - handle.total_bytes // 2)
    with pytest.raises(ParamTransferError, match="checksum mismatch") as info:
        receiver.receive_into(handle, dst)
    assert_byte_exact(dst, v1)
    if transport == "disk":  # a file is named, not its publisher asked to publish again
        assert f"The file {handle.path} is damaged" in str(info.value) and "publish again" not in str(info.value)


@pytest.mark.parametrize("transport", ["shm", "disk"])
def test_a_truncated_bucket_raises_and_leaves_the_previous_tensors_untouched(channels, transport, tmp_path):
    receiver, handle, dst, v1 = loaded_receiver(channels, transport, tmp_path)
    os.truncate(handle.path, os.path.getsize(handle.path) - 4096)
    with pytest.raises(ParamTransferError, match="truncated"):
        receiver.receive_into(handle, dst)
    assert_byte_exact(dst, v1)


class FakePublisher:
    """A ROUTER that serves a real bucket badly: cut off midway, short chunks, or one
    flipped byte. Stands in for a publisher whose link or process fails mid-transfer."""

    def __init__(self, bucket: np.ndarray, fault: str):
        self.bucket, self.fault, self.served = bucket, fault, 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            ident, body = self._sock.recv_multipart()
            key, offset, size = msgspec.msgpack.decode(body)
            if self.fault == "cut" and self.served >= len(self.bucket) // 2:
                continue  # the link is gone: requests go unanswered
            chunk = bytearray(self.bucket[offset : offset + size])
            if self.fault == "short":
                chunk = chunk[:-8]
            if self.fault == "corrupt" and offset == 0:
                chunk[100] ^= 1
            self.served += size
            self._sock.send_multipart([ident, msgspec.msgpack.encode([key, offset, ""]), bytes(chunk)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


@pytest.mark.parametrize("fault, message", [("cut", "no data from"), ("short", "size mismatch"),
                                            ("corrupt", "checksum mismatch")])
def test_a_broken_tcp_transfer_raises_and_leaves_the_previous_tensors_untouched(channels, tmp_path, fault, message):
    receiver, good, dst, v1 = loaded_receiver(channels, "tcp", tmp_path)
    earlier_views = receiver.receive(good)  # a previous copy held as views must survive too
    earlier = snapshot(earlier_views)
    bucket = torch.empty(good.total_bytes, dtype=torch.uint8)
    pack_into(bucket, trained_state(seed=2), good.layout)
    fake = FakePublisher(bucket.numpy(), fault)
    try:
        with pytest.raises(ParamTransferError, match=message):
            receiver.receive_into(msgspec.structs.replace(good, endpoint=fake.endpoint), dst)
        if fault == "cut":
            assert 0 < fake.served < good.total_bytes
    finally:
        fake.close()
    assert_byte_exact(dst, v1)
    assert_byte_exact(earlier_views, earlier)


def test_a_killed_tcp_publisher_makes_the_receive_fail_clearly(channels, processes, shm_dir):
    proc, handle, _ = start_publisher(processes, "tcp", shm_dir)
    proc.kill()
    proc.wait(10)
    with pytest.raises(ParamTransferError, match="publisher died or is unreachable"):
        channels().receive(handle)


def test_a_released_or_forged_handle_is_refused(channels):
    publisher, receiver = channels(), channels()
    handle = publisher.publish(trained_state(), agent="a", version=1, transport="shm")
    with pytest.raises(ParamTransferError, match="no longer holds this publication"):
        receiver.receive(msgspec.structs.replace(handle, key="a-v9-forged"))
    publisher.release(handle)
    with pytest.raises(ParamTransferError, match="is gone"):
        receiver.receive(handle)
    tcp = publisher.publish(trained_state(), agent="a", version=2, transport="tcp")
    publisher.release(tcp)
    with pytest.raises(ParamTransferError, match="released"):
        receiver.receive(tcp)


def test_an_unsealed_segment_is_never_read(channels):
    """The seal is written after the bytes and the checksum; without it, nothing is read."""
    handle = channels().publish(trained_state(), agent="a", version=1, transport="shm")
    with open(handle.path, "r+b") as f:
        f.seek(8)
        f.write(bytes(8))  # the seal field, as it is while a publisher is still writing
    with pytest.raises(ParamTransferError, match="no longer holds this publication"):
        channels().receive(handle)


def test_a_malformed_layout_is_refused_before_any_bytes_move(channels):
    handle = channels().publish({"w": torch.randn(4)}, agent="a", version=1, transport="shm")
    bad = msgspec.structs.replace(handle, layout=[msgspec.structs.replace(handle.layout[0], shape=(400,))])
    with pytest.raises(ParamTransferError, match="does not fit"):
        channels().receive(bad)


def test_an_inproc_handle_from_another_process_is_refused(channels):
    handle = channels().publish({"w": torch.randn(4)}, agent="a", version=1, transport="inproc")
    foreign = msgspec.structs.replace(handle, publisher=Location("h", os.getpid() + 1))
    with pytest.raises(ParamTransferError, match="cannot be received in pid"):
        channels().receive(foreign)


# --- lifetime ---------------------------------------------------------------------------


def test_shm_segments_are_unlinked_when_released(channels, shm_dir):
    channel = channels(spare_buffers=0)
    handle = channel.publish(trained_state(), agent="a", version=1, transport="shm")
    assert os.listdir(shm_dir) == [os.path.basename(handle.path)]
    channel.release(handle)
    assert os.listdir(shm_dir) == []


def test_a_released_segment_is_recycled_under_a_new_name_and_cleaned_on_close(channels, shm_dir):
    publisher, receiver = channels(), channels()
    v1 = publisher.publish(trained_state(seed=1), agent="a", version=1, transport="shm")
    inode = os.stat(v1.path).st_ino
    receiver.receive(v1)
    publisher.release(v1)
    assert not os.path.exists(v1.path)
    v2_state = trained_state(seed=2)
    v2 = publisher.publish(v2_state, agent="a", version=2, transport="shm")
    assert v2.path != v1.path and os.stat(v2.path).st_ino == inode  # no fresh pages to fault in
    assert_byte_exact(receiver.receive(v2), v2_state)
    publisher.release(v2)
    assert len(os.listdir(shm_dir)) == 1  # the spare
    publisher.close()
    assert os.listdir(shm_dir) == []


def test_close_ends_publications_but_keeps_disk_checkpoints(channels, shm_dir, tmp_path):
    channel = channels()
    shm = channel.publish(trained_state(), agent="a", version=1, transport="shm")
    disk = channel.publish(trained_state(), agent="a", version=1, transport="disk", path=tmp_path / "ckpt.params")
    channel.close()
    assert not os.path.exists(shm.path) and os.listdir(shm_dir) == []
    assert read_handle(disk.path) == disk
    assert_byte_exact(channels().receive(read_handle(disk.path)), trained_state())
    with pytest.raises(RuntimeError, match="closed"):
        channel.publish({}, agent="a", version=2, transport="shm")


def test_orphan_segments_of_dead_publishers_are_removed(shm_dir, processes):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    processes.append(dead)
    dead.wait(10)
    orphan = os.path.join(shm_dir, f"flexmarl-param-{dead.pid}-0-abcd")
    mine = os.path.join(shm_dir, f"flexmarl-param-{os.getpid()}-0-abcd")
    for path in (orphan, mine):
        open(path, "wb").close()
    other_orphan = os.path.join(shm_dir, f"flexmarl-param-{dead.pid + 100000000}-0-abcd")  # no such pid
    open(other_orphan, "wb").close()
    assert remove_orphan_segments(shm_dir, pids=[dead.pid]) == [orphan]  # only the pids named
    assert remove_orphan_segments(shm_dir) == [other_orphan]
    assert os.listdir(shm_dir) == [os.path.basename(mine)]


# --- shared buckets: a publisher whose tensors already live in shared memory -----------


CHECKSUM_ON_A_THREAD = pytest.mark.parametrize("defer", [0, 1 << 40], ids=["checksum-on-thread", "checksum-in-publish"])


@CHECKSUM_ON_A_THREAD
def test_a_shared_bucket_is_published_in_place_and_received_byte_exactly(channels, shm_dir, defer):
    publisher, receiver = channels(defer_checksum_bytes=defer), channels()
    state = trained_state(seed=3)
    bucket = publisher.shared_bucket(state)
    assert_byte_exact(bucket.tensors, state)
    handle = publisher.publish(bucket, agent="a", version=1, transport="shm")
    assert handle.path == bucket.segment.path  # sealed where the tensors live: nothing copied
    assert (handle.checksum is None) == (defer == 0)  # on a thread, it follows in the header
    assert_byte_exact(receiver.receive(handle), state)
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    receiver.receive_into(handle, dst, atomic=False)
    assert_byte_exact(dst, state)
    assert len(os.listdir(shm_dir)) == 1
    # Over any other transport a bucket is just its tensors.
    tcp = publisher.publish(bucket, agent="a", version=1, transport="tcp")
    assert_byte_exact(receiver.receive(tcp), state)


@CHECKSUM_ON_A_THREAD
def test_writing_to_a_published_bucket_moves_it_and_the_publication_stays_frozen(channels, shm_dir, defer):
    publisher, receiver = channels(defer_checksum_bytes=defer), channels()
    state = trained_state(seed=4)
    bucket = publisher.shared_bucket(state)
    assert bucket.prepare_write() is False  # nothing published: write in place
    v1 = publisher.publish(bucket, agent="a", version=1, transport="shm")
    assert bucket.prepare_write() is True and bucket.moves == 1
    assert bucket.segment.path != v1.path
    for t in bucket.tensors.values():
        t.add_(1) if t.is_floating_point() else None
    assert_byte_exact(receiver.receive(v1), state)  # the receiver still gets version 1 exactly
    v2 = publisher.publish(bucket, agent="a", version=2, transport="shm")
    assert_byte_exact(receiver.receive(v2), bucket.tensors)
    assert bucket.prepare_write() is True  # v2 is live: moves again, into a fresh segment
    publisher.release(v1)  # v1's segment was left to it: released, it becomes a spare
    publisher.release(v2)
    assert bucket.prepare_write() is False  # released: written in place from now on
    bucket.close()
    publisher.close()
    assert os.listdir(shm_dir) == []


def test_a_bucket_published_twice_while_live_keeps_both_publications_valid(channels):
    publisher, receiver = channels(), channels()
    state = trained_state(seed=5)
    bucket = publisher.shared_bucket(state)
    first = publisher.publish(bucket, agent="a", version=1, transport="shm")
    second = publisher.publish(bucket, agent="a", version=1, transport="shm")
    assert first.path != second.path
    assert_byte_exact(receiver.receive(first), state)
    assert_byte_exact(receiver.receive(second), state)


def test_closing_a_bucket_under_a_live_publication_keeps_it_until_released(channels, shm_dir):
    publisher, receiver = channels(spare_buffers=0), channels()
    state = trained_state(seed=6)
    bucket = publisher.shared_bucket(state)
    handle = publisher.publish(bucket, agent="a", version=1, transport="shm")
    bucket.close()
    assert_byte_exact(receiver.receive(handle), state)
    publisher.release(handle)
    assert os.listdir(shm_dir) == []
    with pytest.raises(RuntimeError, match="closed SharedBucket"):
        publisher.publish(bucket, agent="a", version=2, transport="shm")


def test_a_bucket_moves_between_two_processes_byte_exactly(processes, shm_dir, channels):
    """The publisher checksums on a thread (defer_checksum_bytes=0); the receiver waits for it."""
    proc, handle, digests = start_publisher(processes, "shm", shm_dir, script=BUCKET_PUBLISHER_SCRIPT)
    dst = {spec.name: torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype)) for spec in handle.layout}
    channels().receive_into(handle, dst, atomic=False)
    assert {k: digest(v) for k, v in dst.items()} == digests
    tell(proc, "close")


@CHECKSUM_ON_A_THREAD
def test_a_fused_receive_catches_corruption_and_says_the_destination_is_spoilt(channels, defer):
    publisher, receiver = channels(defer_checksum_bytes=defer), channels()
    state = trained_state(seed=7)
    handle = publisher.publish(publisher.shared_bucket(state), agent="a", version=1, transport="shm")
    receiver.receive(handle)  # returns once the publisher's checksum is in the header
    flip_byte(handle.path, os.path.getsize(handle.path) - handle.total_bytes // 3)
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ParamTransferError, match="checksum mismatch.*must be discarded"):
        receiver.receive_into(handle, dst, atomic=False)
    with pytest.raises(ParamTransferError, match="checksum mismatch"):  # the atomic default, too
        receiver.receive_into(handle, dst)


def test_a_fused_receive_still_refuses_released_segments_and_wrong_destinations(channels):
    publisher, receiver = channels(), channels()
    state = trained_state(seed=8)
    handle = publisher.publish(publisher.shared_bucket(state), agent="a", version=1, transport="shm")
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    wrong = dict(dst, extra=torch.zeros(1))
    with pytest.raises(ValueError, match="extra"):
        receiver.receive_into(handle, wrong, atomic=False)
    assert all(not t.any() for t in dst.values())
    publisher.release(handle)
    with pytest.raises(ParamTransferError, match="no longer holds|is gone"):
        receiver.receive_into(handle, dst, atomic=False)
    assert all(not t.any() for t in dst.values())


BUCKET_PUBLISHER_SCRIPT = r"""
import importlib.util, json, sys, torch, msgspec
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("param_tests", sys.argv[1])
tests = importlib.util.module_from_spec(spec); spec.loader.exec_module(tests)
from flexmarl.runtime.params.channel import ParamChannel, ParamChannelConfig
channel = ParamChannel(ParamChannelConfig(shm_dir=sys.argv[3], defer_checksum_bytes=0))
bucket = channel.shared_bucket(tests.trained_state(seed=1))
bucket.prepare_write()
for t in bucket.tensors.values():
    t.mul_(2) if t.is_floating_point() else None
handle = channel.publish(bucket, agent="planner", version=1, transport="shm")
print(json.dumps({"handle": msgspec.msgpack.encode(handle).hex(),
                  "digests": {k: tests.digest(v) for k, v in bucket.tensors.items()}}), flush=True)
for line in sys.stdin:
    print(json.dumps(line.strip()), flush=True)
    if line.strip() == "close":
        channel.close()
        break
"""


# --- tcp security -----------------------------------------------------------------------


def test_tcp_refuses_to_serve_beyond_loopback_without_curve_keys():
    with pytest.raises(ValueError, match="without authentication"):
        ParamChannel(ParamChannelConfig(tcp_bind_host="0.0.0.0"))


def test_tcp_with_curve_keys_moves_tensors_and_a_wrong_server_key_fails(channels):
    public, secret = (k.decode() for k in zmq.curve_keypair())
    publisher = channels(curve_public_key=public, curve_secret_key=secret)
    state = trained_state()
    handle = publisher.publish(state, agent="a", version=1, transport="tcp")
    assert handle.server_key == public
    assert_byte_exact(channels().receive(handle), state)
    impostor = zmq.curve_keypair()[0].decode()
    with pytest.raises(ParamTransferError, match="no data from"):
        channels(timeout_s=0.5).receive(msgspec.structs.replace(handle, server_key=impostor))


# --- checksum, layout, transport choice -------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.int64]),
                          st.integers(0, 3000)), max_size=6), st.integers(0, 2**32 - 1))
def test_the_checksum_computed_while_packing_equals_the_checksum_of_the_bucket(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": torch.randint(0, 100, (n,), generator=gen).to(dtype) for i, (dtype, n) in enumerate(shapes)}
    layout, total = plan_layout(tensors)
    bucket = torch.full((total,), 0xAB, dtype=torch.uint8)  # stale bytes: padding must be zeroed
    assert pack_into(bucket, tensors, layout) == checksum(bucket)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4096).map(lambda n: n * 8), st.data())
def test_the_checksum_catches_any_single_changed_byte(nbytes, data):
    bucket = torch.from_numpy(np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8))
    before = checksum(bucket)
    where = data.draw(st.integers(0, nbytes - 1))
    bucket[where] ^= data.draw(st.integers(1, 255))
    assert checksum(bucket) != before


def test_the_checksum_catches_top_bit_flips_truncation_and_swapped_blocks():
    bucket = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 3 * CHECKSUM_BLOCK, dtype=np.uint8))
    whole = checksum(bucket)
    for length, word in ((64, 0), (len(bucket), 0), (len(bucket), CHECKSUM_BLOCK // 8 + 3)):
        flipped = bucket[:length].clone()
        flipped[8 * word + 7] ^= 0x80  # the sign bit: moves the block sum by exactly 2**63
        assert checksum(flipped) != checksum(bucket[:length])
    padded = torch.cat([bucket, torch.zeros(8, dtype=torch.uint8)])
    assert checksum(bucket[:-8]) != whole and checksum(padded) != whole
    swapped = torch.cat([bucket[CHECKSUM_BLOCK : 2 * CHECKSUM_BLOCK], bucket[:CHECKSUM_BLOCK], bucket[2 * CHECKSUM_BLOCK :]])
    assert checksum(swapped) != whole


def test_choose_transport_picks_the_cheapest_path_between_locations():
    here = Location("node-a", 10, "cpu")
    assert choose_transport(here, here) == "inproc"
    assert choose_transport(here, Location("node-a", 11, "cpu")) == "shm"
    assert choose_transport(here, Location("node-b", 10, "cpu")) == "tcp"
    gpu = Location("node-a", 10, "cuda:0")
    assert choose_transport(gpu, Location("node-a", 11, "cuda:0")) == "cuda_ipc"
    assert choose_transport(gpu, Location("node-a", 11, "cuda:1")) == "nccl"  # another GPU, same host
    assert choose_transport(gpu, Location("node-b", 11, "cuda:0")) == "nccl"  # "cuda:0" of another host
    assert choose_transport(gpu, Location("node-b", 11, "cuda:1")) == "nccl"
    assert choose_transport(gpu, Location("node-a", 11, "cpu")) == "shm"
    assert choose_transport(gpu, Location("node-b", 11, "cpu")) == "tcp"


def test_a_handle_describes_the_layout_once_and_stays_small(channels):
    state = trained_state()
    handle = channels().publish(state, agent="a", version=1, transport="shm")
    assert [spec.name for spec in handle.layout] == list(state)
    assert len(msgspec.msgpack.encode(handle)) < 100 * len(state)


# --- GPU transports (skipped without CUDA) ----------------------------------------------


@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_gpu_transports_refuse_cpu_tensors_and_cuda_less_receivers_clearly(channels, transport):
    with pytest.raises(ValueError, match="from one CUDA device"):
        channels().publish({"w": torch.randn(4)}, agent="a", version=1, transport=transport)
    if torch.cuda.is_available():
        return
    shm = channels().publish({"w": torch.randn(4)}, agent="a", version=1, transport="shm")
    gpu_handle = msgspec.structs.replace(shm, transport=transport, path=None,
                                         cuda_ipc=CudaIpcInfo(0, b"h", 64),
                                         nccl=NcclInfo(bytes(128), 2))
    with pytest.raises(ParamTransferError, match="no CUDA device"):
        channels().receive(gpu_handle, rank=1)



@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_moves_a_model_state_between_processes_byte_exactly(processes, shm_dir):
    proc, handle, digests = start_publisher(processes, "cuda_ipc", shm_dir, device="cuda:0")
    receiver = ParamChannel(location=Location.here("cuda:0"))
    try:
        got = receiver.receive(handle)
        assert all(t.is_cuda for t in got.values())
        assert {k: digest(v) for k, v in got.items()} == digests
        dst = {k: torch.empty_like(v) for k, v in got.items()}
        del got
        receiver.receive_into(handle, dst)
        assert {k: digest(v) for k, v in dst.items()} == digests
    finally:
        receiver.close()
    tell(proc, "close")
    assert proc.wait(30) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (NCCL refuses two ranks on one GPU)")
def test_nccl_broadcast_moves_a_model_state_between_processes_byte_exactly(processes, shm_dir):
    pytest.importorskip("cupy")
    proc, handle, digests = start_publisher(processes, "nccl", shm_dir, device="cuda:0")
    assert handle.nccl.world_size == 2 and len(handle.nccl.unique_id) == 128
    receiver = ParamChannel(location=Location.here("cuda:1"))
    try:
        got = receiver.receive(handle, rank=1)
        assert {k: digest(v) for k, v in got.items()} == digests
    finally:
        receiver.close()
    tell(proc, "close")
    assert proc.wait(30) == 0


def test_a_receiver_waiting_for_a_dead_publishers_checksum_fails_clearly(channels, processes):
    publisher, receiver = channels(defer_checksum_bytes=0), channels()
    bucket = publisher.shared_bucket(trained_state())
    handle = publisher.publish(bucket, agent="a", version=1, transport="shm")
    receiver.receive(handle)  # the checksum is in the header now
    # As if the publisher had died between sealing the segment and writing its checksum.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    processes.append(dead)
    dead.wait(10)
    struct.pack_into("<Q", bucket.segment.mm, 32, 0)
    orphan = msgspec.structs.replace(handle, publisher=Location(handle.publisher.host, dead.pid))
    dst = {spec.name: torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype)) for spec in handle.layout}
    with pytest.raises(ParamTransferError, match="died or stalled before it finished the checksum"):
        receiver.receive_into(orphan, dst)
    assert not any(t.any() for t in dst.values())  # atomic: nothing written
    for receive in (lambda: receiver.receive(orphan), lambda: receiver.receive_into(orphan, dst, atomic=False)):
        with pytest.raises(ParamTransferError, match="died or stalled before it finished the checksum"):
            receive()


def test_tensors_that_already_are_a_bucket_go_to_disk_as_they_lie_and_are_read_straight_back_verified(
        channels, tmp_path):
    channel = channels()
    state = trained_state()
    bucket = channel.shared_bucket(state)
    names = list(bucket.tensors)[: len(state) // 2]  # a leading part, as a checkpoint takes of a training state
    part = {name: bucket.tensors[name] for name in names}
    handle = channel.publish(part, agent="a", version=1, transport="disk", path=tmp_path / "part.flexmarl")
    assert channel.held_receive_buffers() == 0  # written from where the tensors lie: no host buffer made
    assert all(torch.equal(t, state[k]) for k, t in channel.receive(handle).items())
    into = channels().shared_bucket(state, copy=False)
    dst = {name: into.tensors[name] for name in names}
    reader = channels()
    reader.receive_into(handle, dst, atomic=False)
    assert reader.held_receive_buffers() == 0 and all(torch.equal(dst[k], state[k]) for k in names)
    with open(handle.path, "r+b") as f:  # one flipped byte near the end of the file
        f.seek(-8, 2)
        byte = f.read(1)
        f.seek(-8, 2)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ParamTransferError, match="checksum mismatch"):
        reader.receive_into(handle, dst, atomic=False)


def test_a_shared_buckets_leading_part_is_published_in_place_and_received_alone(channels):
    publisher, receiver = channels(), channels()
    state = trained_state()
    bucket = publisher.shared_bucket(state)
    names = list(state)[: len(state) // 3]
    part = bucket.leading(len(names), lambda name: f"w/{name}")
    handle = publisher.publish(part, agent="a", version=1, transport="shm")
    assert handle.path == bucket.segment.path and handle.total_bytes < bucket.total_bytes  # no copy, its bytes only
    got = receiver.receive(handle)
    assert list(got) == [f"w/{n}" for n in names] and all(torch.equal(got[f"w/{n}"], state[n]) for n in names)
    with pytest.raises(RuntimeError, match="cannot move"):
        part.prepare_write()  # its publication is live, and a part cannot move out from under it
    del got
    receiver.release(handle)
    publisher.release(handle)
    part.close()  # the whole bucket owns the segment: nothing is given back
    whole = publisher.publish(bucket, agent="a", version=2, transport="shm")  # then the whole of it
    assert all(torch.equal(t, state[k]) for k, t in receiver.receive(whole).items())
