"""A checkpoint's manifest: sha256sum's format, every file but itself, and a damaged or
missing file named when checked."""

import subprocess

import pytest

from flexmarl.runtime.checksums import (MANIFEST, DamagedFile, entries_under, read_manifest, verify_files,
                                        write_manifest)


def a_checkpoint(root):
    (root / "solver").mkdir(parents=True)
    (root / "controller.json").write_text("{}")
    (root / "solver" / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (root / "solver" / "config.json").write_text('{"a": 1}')
    return root


def test_the_manifest_lists_every_file_but_itself_and_sha256sum_checks_it(tmp_path):
    root = a_checkpoint(tmp_path / "step-000002")
    entries = write_manifest(root)
    assert sorted(entries) == ["controller.json", "solver/config.json", "solver/model.safetensors"]
    assert read_manifest(root) == entries
    check = subprocess.run(["sha256sum", "-c", MANIFEST], cwd=root, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 3
    verify_files(root, entries)  # intact: no error


def test_a_flipped_byte_and_a_missing_file_are_named(tmp_path):
    root = a_checkpoint(tmp_path / "step-000002")
    entries = write_manifest(root)
    weights = root / "solver" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DamagedFile, match="model.safetensors does not match its checksum") as info:
        verify_files(root, entries)
    assert info.value.path == weights
    (root / "solver" / "config.json").unlink()
    with pytest.raises(DamagedFile, match="config.json is missing"):
        verify_files(root / "solver", entries_under(entries, "solver"))


def test_a_missing_or_torn_manifest_is_named(tmp_path):
    root = a_checkpoint(tmp_path / "step-000002")
    with pytest.raises(DamagedFile, match=f"{MANIFEST} cannot be read"):
        read_manifest(root)
    (root / MANIFEST).write_text("abc  controller.json\n")
    with pytest.raises(DamagedFile, match="line 1 is not"):
        read_manifest(root)


def test_an_agents_entries_are_relative_to_its_directory(tmp_path):
    entries = write_manifest(a_checkpoint(tmp_path / "c"))
    mine = entries_under(entries, "solver")
    assert sorted(mine) == ["config.json", "model.safetensors"]
    verify_files(tmp_path / "c" / "solver", mine)
