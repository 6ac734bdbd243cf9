"""The GPU check's CPU dry run: the same command a lent GPU machine runs, at tiny shapes on
the CPU, so the script cannot rot between loans. Its CUDA-only parts must say they were
skipped, the parts that need vLLM or adapters that they were not run, and everything it
could run on the CPU must have run and matched."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_runs_every_part_it_can_on_the_cpu_and_lists_the_rest(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_part = {}
    for row in rows:
        by_part.setdefault(row["part"], []).append(row)
    assert all(row["ok"] for row in rows)
    assert {"vllm_engine", "nccl_two_ranks"} <= {r["part"] for r in rows if r.get("not_run")}
    lora, = by_part["lora"]  # adapters of one base run on the CPU too
    assert lora["one_base"] and "differ" not in lora and 0 < lora["publish_bytes"] < lora["park_bytes"]
    for part in ("gpu_tests", "fsdp2", "nccl_setup", "fork_safe"):
        assert all(r.get("skipped") for r in by_part[part]), part
    syncs, = by_part["cuda_ipc"]  # the same syncs over shm on the CPU: the first and later ones apart
    assert syncs["transport"] == "shm" and syncs["syncs"] == 3 and len(syncs["receive_s_each"]) == 3
    assert syncs["first_vs_copy"] > 0 and syncs["later_vs_copy"] > 0 and "mismatched" not in syncs
    train = by_part["train"]
    assert {(r["precision"], r["activation_checkpointing"]) for r in train} == {
        ("mixed", False), ("mixed", True), ("pure", False), ("pure", True)}
    assert all(r["tokens_per_s"] > 0 and r["parameters"] > 0 for r in train)
    mfu, = by_part["mfu"]  # the trainer against the matmul, at the tiny shape
    assert mfu["fits"] and mfu["flops"] > 0 and 0 < mfu["of_matmul"] and mfu["target"] == 0.4
    assert "meets_target" in mfu and mfu["peak_gib"] > 0
    received, = by_part["engine_receive"]  # an engine worker's receive, over shm on the CPU
    assert received["transport"] == "shm" and "mismatched" not in received
    assert 0 < received["request_bytes"] < received["bytes"]
    park, = by_part["park"]
    assert park["tensors"] > 0 and "differ" not in park  # byte-exact after a round trip
    assert "GPU CHECK FAILED" not in proc.stderr
    assert any(line.split()[:2] == ["part", "shape"] for line in proc.stdout.splitlines())  # the table
