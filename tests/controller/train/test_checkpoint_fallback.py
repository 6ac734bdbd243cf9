"""A resume starts from a checkpoint checked against its manifest: a damaged newest one is
named and passed over for the newest intact one, `--resume-from` picks one, and what loads
a checkpoint's files is told their digests."""

import hashlib
from pathlib import Path

import pytest
from test_checkpoints import FakeTrainers, checkpointer, save_step

from flexmarl.controller.train.checkpoints import CheckpointError, resume_point, step_dir_name
from flexmarl.runtime.checksums import MANIFEST
from flexmarl.runtime.protocol import TRAINING_STATE_FILE


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


async def three_checkpoints(tmp_path):
    ck, _ = checkpointer(tmp_path, FakeTrainers(), every=2, keep=3, steps=6)
    for step in (2, 4, 6):
        await save_step(ck, step)
    return tmp_path / "checkpoints"


async def test_a_checkpoint_is_written_with_its_manifest_last(tmp_path):
    root = await three_checkpoints(tmp_path)
    point = resume_point(tmp_path)
    assert point.step == 6 and (point.path / MANIFEST).is_file()
    assert sorted(point.manifest) == ["controller.json", "planner/model.safetensors", "solver/model.safetensors"]
    assert point.agent_checksums("solver") == {"model.safetensors": point.manifest["solver/model.safetensors"]}
    assert not list(root.glob(".*partial"))


async def test_a_damaged_newest_checkpoint_is_named_and_the_newest_intact_one_resumed(tmp_path):
    root = await three_checkpoints(tmp_path)
    flip_a_byte(root / step_dir_name(6) / "solver" / "model.safetensors")
    (root / step_dir_name(4) / "planner" / "model.safetensors").write_bytes(b"")  # truncated
    said = []
    point = resume_point(tmp_path, warn=said.append)
    assert point.step == 2
    assert "step 6 is damaged" in said[0] and "solver/model.safetensors does not match its checksum" in said[0]
    assert "step 4 is damaged" in said[1] and "planner/model.safetensors does not match" in said[1]
    assert said[2] == "resuming from the checkpoint of step 2 instead, the newest intact one"


async def test_a_checkpoint_without_its_manifest_is_not_resumed_from(tmp_path):
    root = await three_checkpoints(tmp_path)
    (root / step_dir_name(6) / MANIFEST).unlink()
    said = []
    assert resume_point(tmp_path, warn=said.append).step == 4
    assert f"{MANIFEST} cannot be read" in said[0]


async def test_resume_from_picks_a_checkpoint_and_refuses_a_damaged_or_missing_one(tmp_path):
    root = await three_checkpoints(tmp_path)
    assert resume_point(tmp_path, 4).step == 4
    flip_a_byte(root / step_dir_name(4) / "controller.json")
    with pytest.raises(CheckpointError, match=r"step 4 is damaged: .*controller.json does not match"):
        resume_point(tmp_path, 4)
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 5 \(it has: step-000006, step-000004, "
                                              r"step-000002\)"):
        resume_point(tmp_path, 5)


async def test_when_every_checkpoint_is_damaged_the_resume_stops_naming_each(tmp_path):
    root = await three_checkpoints(tmp_path)
    for step in (2, 4, 6):
        flip_a_byte(root / step_dir_name(step) / "planner" / "model.safetensors")
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged .*step 6: .*step 4: .*step 2: "):
        resume_point(tmp_path, warn=lambda line: None)


class SavingStates(FakeTrainers):
    async def call(self, worker, msg):
        reply = await super().call(worker, msg)
        (Path(msg.path) / TRAINING_STATE_FILE).write_bytes(msg.agent.encode() * 100)
        return reply


async def test_an_agent_restored_mid_run_is_loaded_with_its_files_digest(tmp_path):
    ck, _ = checkpointer(tmp_path, SavingStates(), every=2, steps=6)
    await ck.save_agent("planner", "trainer-0", 2)
    assert ck.agent_state_checksum("planner", 2) == ""  # the cut is not complete yet: no manifest
    await ck.save_agent("solver", "trainer-0", 2)
    point = resume_point(tmp_path)
    digest = point.manifest["planner/training_state.flexmarl"]
    assert ck.agent_state_checksum("planner", 2) == digest == point.training_state_checksum("planner")
    assert digest == hashlib.sha256(b"planner" * 100).hexdigest()
