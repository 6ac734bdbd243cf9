#!/usr/bin/env bash
# Starts worker processes on this host, connected to a controller; Ctrl-C stops them all.
#   scripts/start_workers.sh ADDR [ROLLOUT_COUNT] [TRAINER_COUNT] [--curve-dir DIR] [--param-host ADDR]
# Worker ids are ROLE-HOSTNAME-I, so each host's are distinct. A controller off loopback
# needs --curve-dir; workers then serve parameters to other hosts on the address facing the
# controller (or --param-host). FLEXMARL_SKIP_SETUP=1 skips scripts/setup_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
addr=${1:?usage: start_workers.sh ADDR [ROLLOUT_COUNT] [TRAINER_COUNT] [extra worker options]}
rollouts=${2:-1}
trainers=${3:-1}
shift $(( $# >= 3 ? 3 : $# ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_ENABLE_V1_MULTIPROCESSING=0
host=$(hostname)
pids=()
stop() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; wait; }
trap stop INT TERM
for i in $(seq 0 $((rollouts - 1))); do
  .venv/bin/flexmarl worker --role rollout --connect "$addr" --worker-id "rollout-$host-$i" "$@" & pids+=($!)
done
for i in $(seq 0 $((trainers - 1))); do
  .venv/bin/flexmarl worker --role trainer --connect "$addr" --worker-id "trainer-$host-$i" "$@" & pids+=($!)
done
echo "started workers: ${pids[*]} (Ctrl-C stops them)"
wait
