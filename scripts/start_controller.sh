#!/usr/bin/env bash
# Starts the controller only; workers on any host connect to it.
#   scripts/start_controller.sh CONFIG.toml [BIND_ADDR] [extra flexmarl options...]
# A non-loopback BIND_ADDR needs CURVE keys: `flexmarl keys DIR` and --set transport.curve_dir=DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
config=${1:?usage: start_controller.sh CONFIG.toml [BIND_ADDR] [options]}
bind=${2:-tcp://127.0.0.1:5555}
shift $(( $# >= 2 ? 2 : 1 ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/flexmarl controller --config "$config" --bind "$bind" "$@"
