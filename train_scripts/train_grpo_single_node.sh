#!/usr/bin/env bash
# GRPO on one 8-GPU node with ngramrl rollouts (4 vLLM engines + 4 DeepSpeed ranks): ray_configs/gpu_single_node.yaml.
# Usage: bash train_scripts/train_grpo_single_node.sh [--set section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ngramrl.cli train --check --config ray_configs/gpu_single_node.yaml "$@"   # fail fast, before Ray
exec "$PYTHON" -m ngramrl.cli train --config ray_configs/gpu_single_node.yaml "$@"
