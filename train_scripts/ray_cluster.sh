#!/usr/bin/env bash
# Start (or stop) the Ray cluster for multi-node runs, in OpenRLHF's style.
#   on the head node:    bash train_scripts/ray_cluster.sh head
#   on every other node: HEAD_ADDR=<head ip> bash train_scripts/ray_cluster.sh worker
#   anywhere, at the end: bash train_scripts/ray_cluster.sh stop
# Ports, resources and the dashboard address come from ray_configs/cluster.env.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null
source ray_configs/cluster.env
ROLE=${1:?usage: ray_cluster.sh head or worker or stop}
THIS_ADDR=$(hostname -I | awk '{print $1}')
case "$ROLE" in
  head)
    ray start --head --node-ip-address "${HEAD_ADDR:-$THIS_ADDR}" --port "$RAY_PORT" \
      --dashboard-host 0.0.0.0 --dashboard-port "$DASHBOARD_PORT" --num-gpus "$GPUS_PER_NODE" ;;
  worker)
    : "${HEAD_ADDR:?set HEAD_ADDR to the address of the head node}"
    ray start --address "$HEAD_ADDR:$RAY_PORT" --num-gpus "$GPUS_PER_NODE" ;;
  stop)
    ray stop ;;
  *)
    echo "unknown role $ROLE (head, worker or stop)" >&2; exit 2 ;;
esac
