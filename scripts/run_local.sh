#!/usr/bin/env bash
# Controller and workers on this host as separate commands (what two hosts would run),
# over loopback. Ctrl-C stops everything this script started.
#   scripts/run_local.sh [CONFIG.toml] [extra flexmarl options...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
config=${1:-examples/default.toml}
shift $(( $# >= 1 ? 1 : 0 ))
port=${FLEXMARL_PORT:-5555}
addr="tcp://127.0.0.1:$port"
rollouts=$(.venv/bin/python -c "import sys,tomllib; c=tomllib.load(open(sys.argv[1],'rb')); print(c.get('cluster',{}).get('rollout_workers',3))" "$config")
trainers=$(.venv/bin/python -c "import sys,tomllib; c=tomllib.load(open(sys.argv[1],'rb')); print(c.get('cluster',{}).get('trainer_workers',1))" "$config")
envs=$(.venv/bin/python -c "import sys,tomllib; c=tomllib.load(open(sys.argv[1],'rb')); print(c.get('cluster',{}).get('env_workers',0))" "$config")
export OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
.venv/bin/flexmarl controller --config "$config" --bind "$addr" "$@" & ctl=$!
bash scripts/start_workers.sh "$addr" "$rollouts" "$trainers" "$envs" & wrk=$!
stop() { kill -TERM "$ctl" "$wrk" 2>/dev/null || true; wait; }
trap stop INT TERM
wait "$ctl"; status=$?
kill -TERM "$wrk" 2>/dev/null || true
wait "$wrk" || true
exit $status
