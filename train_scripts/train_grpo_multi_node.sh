#!/usr/bin/env bash
# GRPO on a Ray cluster (start it with train_scripts/ray_cluster.sh on every node first), submitted as a Ray job:
# ray_configs/gpu_multi_node.yaml, runtime environment in ray_configs/runtime_env.yaml.
# Usage: bash train_scripts/train_grpo_multi_node.sh [--set section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null
source ray_configs/cluster.env
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH  # the cluster refuses requests without its token
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ngramrl.cli train --check --config ray_configs/gpu_multi_node.yaml "$@"    # fail fast, before submitting
exec ray job submit --address "http://$DASHBOARD_HOST:$DASHBOARD_PORT" \
  --runtime-env ray_configs/runtime_env.yaml \
  -- python3 -m ngramrl.cli train --config ray_configs/gpu_multi_node.yaml "$@"
