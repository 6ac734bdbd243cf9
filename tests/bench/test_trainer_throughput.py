"""bench/micro/trainer_throughput.py at a tiny shape: every (tokens, checkpointing) child runs a real
trainer step and reports its FLOP/s against the matmul it timed, and its peak memory; the
FLOP count and the micro-batch draw it reports are checked by hand on small cases."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "micro"))

import trainer_throughput as tt  # noqa: E402


def test_the_smoke_run_measures_a_real_step_with_and_without_activation_checkpointing():
    proc = subprocess.run([sys.executable, "bench/micro/trainer_throughput.py", "--smoke", "--profile", "5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["activation_checkpointing"] for r in rows] == [False, True]
    for r in rows:
        assert r["ok"] and r["fits"] and r["seconds"] > 0 and r["matmul_flops_per_s"] > 0
        assert r["of_matmul"] == r["flops"] / r["seconds"] / r["matmul_flops_per_s"]
        assert r["peak_gib"] >= r["resident_gib"] > 0
        assert r["tokens"] == sum(r["prompt_lengths"]) + sum(r["output_lengths"])
        # --profile: one more step's costliest operators, most costly first, within its busy time
        top = r["profile"]["top"]
        assert len(top) == 5 and [ms for *_, ms in top] == sorted((ms for *_, ms in top), reverse=True)
        assert sum(ms for *_, ms in top) <= r["profile"]["busy_ms"] + 1e-6
    assert "of matmul" in proc.stdout  # the table


def test_groups_are_drawn_whole_until_the_next_would_pass_the_budget():
    groups = tt.draw_groups(4096, 4, seed=3)
    sizes = [p + sum(outs) for p, outs in groups]
    assert sum(sizes) <= 4096 or len(groups) == 1
    assert all(64 <= p <= 512 and len(outs) == 4 and all(16 <= n <= 1024 for n in outs) for p, outs in groups)
    assert tt.draw_groups(4096, 4, seed=3) == groups  # seeded


def test_flops_count_each_prompt_once_and_every_output_input_and_context():
    config = SimpleNamespace(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=16, vocab_size=10, head_dim=4)
    # One group: prompt of 2, outputs of 1 and 3 tokens. Inputs: 2 + 0 + 2 = 4 positions;
    # contexts: prompt 1 + 2, second output's inputs 3 + 4 (the first output has none).
    got = tt.train_flops(config, [(2, [1, 3])])
    weights = 8 * 8 * 2 + 8 * 4 * 2 + 3 * 8 * 16
    forward = 2 * weights * 4 + 2 * 8 * 10 * 4 + 4 * 1 * 2 * 4 * (1 + 2 + 3 + 4)
    assert got["flops"] == 3 * forward and got["tokens"] == 6 and got["input_tokens"] == 4
