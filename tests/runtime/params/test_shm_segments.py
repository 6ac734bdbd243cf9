"""What workers leave in shared memory is named by their pid: a rollout engine's adapter
and cancellation directories of a process that is gone are removed, a live one's never."""

import os
import subprocess
import sys

from flexmarl.runtime.params.shm_segments import (
    CANCEL_PREFIX,
    LORA_PREFIX,
    SEGMENT_PREFIX,
    remove_orphan_engine_dirs,
    remove_orphan_segments,
)


def test_a_dead_engines_directories_are_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = [tmp_path / f"{LORA_PREFIX}{dead.pid}-x1", tmp_path / f"{CANCEL_PREFIX}{dead.pid}-x2"]
    mine = [tmp_path / f"{LORA_PREFIX}{os.getpid()}-y1", tmp_path / f"{CANCEL_PREFIX}{os.getpid()}-y2"]
    for d in left + mine:
        (d / "adapter").mkdir(parents=True)
        (d / "adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 1024)
    segment = tmp_path / f"{SEGMENT_PREFIX}{dead.pid}-0-abcd"
    segment.write_bytes(b"\0")
    assert remove_orphan_engine_dirs(pids=[os.getpid()], directory=str(tmp_path)) == []  # alive: kept
    assert sorted(remove_orphan_engine_dirs(directory=str(tmp_path))) == sorted(map(str, left))
    assert all(d.is_dir() for d in mine) and not any(d.exists() for d in left)
    assert segment.exists()  # a parameter segment is not an engine's: a parked copy may still be loaded from it
    assert remove_orphan_segments(str(tmp_path), pids=[dead.pid]) == [str(segment)]


def test_a_segment_is_named_with_its_owner_and_removed_by_anyone_only_once_publisher_and_owner_are_gone(
        tmp_path, monkeypatch):
    from flexmarl.runtime.params.shm_segments import OWNER_ENV, remove_abandoned_segments, segment_stem

    monkeypatch.setenv(OWNER_ENV, "123")
    assert segment_stem() == f"{SEGMENT_PREFIX}{os.getpid()}-o123-"
    gone = []
    for _ in range(2):
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        gone.append(p.pid)
    publisher, owner = gone
    abandoned = tmp_path / f"{SEGMENT_PREFIX}{publisher}-o{owner}-b1234"  # a crashed run: both gone
    owned = tmp_path / f"{SEGMENT_PREFIX}{publisher}-o{os.getpid()}-b5678"  # its controller may still load it
    by_hand = tmp_path / f"{SEGMENT_PREFIX}{publisher}-o0-b9abc"  # no owner known: left to its own clean-up
    live = tmp_path / f"{SEGMENT_PREFIX}{os.getpid()}-o{owner}-bdef0"  # its publisher runs
    for path in (abandoned, owned, by_hand, live):
        path.write_bytes(b"\0")
    assert remove_abandoned_segments(str(tmp_path)) == [str(abandoned)]
    assert all(p.exists() for p in (owned, by_hand, live))
