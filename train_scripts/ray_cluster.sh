#!/usr/bin/env bash
# Start (or stop) the Ray cluster for multi-node runs; only its owner can use it.
#   on the head node:    bash train_scripts/ray_cluster.sh head
#   on every other node: HEAD_ADDR=<head ip> bash train_scripts/ray_cluster.sh worker
#   anywhere, at the end: bash train_scripts/ray_cluster.sh stop
# Extra arguments go to `ray start`. Ports and resources come from ray_configs/cluster.env.
#
# Ray's token authentication is on: every request to the cluster (GCS, dashboard, job API) must
# carry its token, or it is refused. The head creates the token once, readable by you alone, in
# $RAY_AUTH_TOKEN_PATH (default ~/.ray/ngramrl_auth_token); the worker nodes and the scripts that
# submit jobs read the same file (a home directory shared by the nodes, or copy it there).
# The dashboard and job API listen on $DASHBOARD_HOST, the head's loopback by default: from your
# own machine, reach them with `ssh -L 8265:127.0.0.1:8265 <head>` and http://127.0.0.1:8265.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null
source ray_configs/cluster.env
ROLE=${1:?usage: ray_cluster.sh head or worker or stop [ray start arguments]}
shift
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/ngramrl_auth_token}
THIS_ADDR=$(hostname -I 2>/dev/null | awk '{print $1}')

case "$ROLE" in
  head)
    if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
      mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
      (umask 077 && python3 -c "import secrets; print(secrets.token_hex(32), end='')" > "$RAY_AUTH_TOKEN_PATH")
      echo "ray_cluster.sh: new cluster token in $RAY_AUTH_TOKEN_PATH" >&2
    fi
    exec ray start --head --node-ip-address "${HEAD_ADDR:-${THIS_ADDR:-127.0.0.1}}" --port "$RAY_PORT" \
      --dashboard-host "${DASHBOARD_HOST:-127.0.0.1}" --dashboard-port "$DASHBOARD_PORT" \
      --num-gpus "$GPUS_PER_NODE" "$@" ;;
  worker)
    : "${HEAD_ADDR:?set HEAD_ADDR to the address of the head node}"
    [ -s "$RAY_AUTH_TOKEN_PATH" ] || { echo "ray_cluster.sh: no cluster token at $RAY_AUTH_TOKEN_PATH" \
      "(copy it from the head node)" >&2; exit 2; }
    exec ray start --address "$HEAD_ADDR:$RAY_PORT" --num-gpus "$GPUS_PER_NODE" "$@" ;;
  stop)
    exec ray stop "$@" ;;
  *)
    echo "unknown role $ROLE (head, worker or stop)" >&2; exit 2 ;;
esac
