#!/usr/bin/env bash
# Downloads the wheels scripts/gpu_check.sh installs on a GPU machine without PyPI: the
# Python dependencies of FlexMARL's worker and test code that such a machine lacks, for
# CPython 3.12 on x86-64 Linux (change PY_VERSION for another). Into .whl/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  pyzmq==27.3.0 msgspec==0.22.0 pytest==9.2.0 pytest-asyncio==1.5.0
ls -l .whl
