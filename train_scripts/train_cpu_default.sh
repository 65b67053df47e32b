#!/usr/bin/env bash
# The CPU default: GRPO of SmolLM2-135M-Instruct with ngramrl rollouts on this machine (no GPU, offline).
# Usage: bash train_scripts/train_cpu_default.sh [--set section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}   # a private single-machine Ray
export WANDB_MODE=${WANDB_MODE:-offline}
exec "$PYTHON" -m ngramrl.cli train --config ray_configs/cpu_default.yaml "$@"
