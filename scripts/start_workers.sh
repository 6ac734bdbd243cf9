#!/usr/bin/env bash
# Starts worker processes on this host, connected to a controller; Ctrl-C stops them all.
#   scripts/start_workers.sh ADDR [ROLLOUT_COUNT] [TRAINER_COUNT] [ENV_COUNT] [--curve-dir DIR] [--param-host ADDR]
# Counts default to 1 rollout, 1 trainer and 0 environment workers (an environment worker
# runs the workflow's tools and rewards: give it a host of CPUs, it needs no GPU).
# Worker ids are ROLE-HOSTNAME-I, so each host's are distinct. A controller off loopback
# needs --curve-dir; workers then serve parameters to other hosts on the address facing the
# controller (or --param-host). FLEXMARL_SKIP_SETUP=1 skips scripts/setup_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
addr=${1:?usage: start_workers.sh ADDR [ROLLOUT_COUNT] [TRAINER_COUNT] [ENV_COUNT] [extra worker options]}
shift
counts=()
while (( $# > 0 && ${#counts[@]} < 3 )) && [[ $1 =~ ^[0-9]+$ ]]; do counts+=("$1"); shift; done
rollouts=${counts[0]:-1}
trainers=${counts[1]:-1}
envs=${counts[2]:-0}
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
for i in $(seq 0 $((envs - 1))); do
  .venv/bin/flexmarl worker --role env --connect "$addr" --worker-id "env-$host-$i" "$@" & pids+=($!)
done
echo "started workers: ${pids[*]} (Ctrl-C stops them)"
wait
