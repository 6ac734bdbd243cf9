#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a CUDA machine that has torch, CuPy and transformers
# but not all of FlexMARL's own Python dependencies, and no project install.
#
#   bash scripts/gpu_wheels.sh            # where PyPI is reachable: the wheels into .whl/
#   bash scripts/gpu_check.sh [ARGS...]   # on the GPU machine, with .whl/ beside it
#
# The wheels (pyzmq, msgspec, pytest, pytest-asyncio) are installed into a private folder,
# never into the machine's Python; FlexMARL is imported from this checkout through a
# folder of links named as its packages (flexmarl.runtime -> runtime/, ...). Where FlexMARL
# is installed already (make setup on a CUDA machine), run scripts/gpu_check.py directly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
site=${FLEXMARL_GPU_SITE:-/tmp/flexmarl-gpu-site}
mkdir -p "$site/flexmarl"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
fi
for pkg in runtime controller workers; do ln -sfn "$PWD/$pkg" "$site/flexmarl/$pkg"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"
