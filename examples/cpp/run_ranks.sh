#!/usr/bin/env bash
# Run a program as N ranks on this machine with torchrun's environment variables:  run_ranks.sh N PROGRAM [ARGS...]
set -uo pipefail
N=${1:?usage: run_ranks.sh N PROGRAM [ARGS...]}
shift
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT WORLD_SIZE=$N SHARDTENSOR_GLOO_HOST=127.0.0.1
pids=()
for ((r = 1; r < N; r++)); do
  RANK=$r LOCAL_RANK=$r timeout 900 "$@" > /dev/null &
  pids+=($!)
done
RANK=0 LOCAL_RANK=0 timeout 900 "$@"
status=$?
for p in "${pids[@]}"; do
  wait "$p" || { s=$?; [[ $status -eq 0 ]] && status=$s; }
done
exit $status
