#!/usr/bin/env bash
# The GPU check (docs/gpu.md): a step profile of a Qwen3-8B shape measured on this machine's GPU;
# the drafting proposer's step times on this machine's CPU (a GPU server's); then the projection
# of the shipped traces through the measured profile at engine batches 1, 32, 128 and 512.
#
#     bash scripts/gpu_check.sh OUTDIR
#
# Needs only Python with PyTorch and numpy (no vLLM, no network, ngramrl not installed: it runs
# from this checkout). It builds the native drafting core in place where a compiler and pybind11
# are at hand (else the drafting times are the Python reference's, and env.txt says so). Writes
# eight small files to OUTDIR: env.txt, profile.json (+ .log), roofline.json, bench_steps.json,
# projection.json (+ .txt), progress.txt. Each stage has a time limit: with the defaults they add
# up to 9 minutes (BUILD + PROFILE + 60 s to build the model + STEPS + PROJECT), so the check fits a
# 10-minute window (an H200 with a 16-core host took 64 s for the default profile). The step times
# and the projection write what they finished as they go: one cut off by its limit leaves those
# runs in OUTDIR, and progress.txt and the last lines printed say how far it got.
#
# Settings (environment): MODEL (qwen3-8b), DEVICE (cuda), QUICK (0; 1 for the small grid),
# BUILD_BUDGET_S (60), PROFILE_BUDGET_S (120), STEPS_BUDGET_S (120), PROJECT_BUDGET_S (180),
# BATCHES ("1 32 128 512"), TRACES (the shipped ones), METHODS ("none pld suffix ngramrl
# ngramrl-prefetch"; suffix is skipped, saying so, where arctic-inference is not installed),
# JOBS (projection processes; the cores less two, at least 1), STEP_TRACES (the gsm T=0.6
# trace), STEP_BATCHES ("256 1024"), STEP_THREADS ("1 2 8"), PYTHON (python3).
set -u

if [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu_check.sh OUTDIR" >&2
    exit 2
fi
OUT=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
MODEL=${MODEL:-qwen3-8b}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
BUILD_BUDGET_S=${BUILD_BUDGET_S:-60}
PROFILE_BUDGET_S=${PROFILE_BUDGET_S:-120}
STEPS_BUDGET_S=${STEPS_BUDGET_S:-120}
PROJECT_BUDGET_S=${PROJECT_BUDGET_S:-180}
BATCHES=${BATCHES:-1 32 128 512}
METHODS=${METHODS:-none pld suffix ngramrl ngramrl-prefetch}
# the trace lists as arrays: a checkout's path may hold spaces (TRACES and STEP_TRACES, when
# given, are split at spaces)
if [ -n "${TRACES:-}" ]; then read -r -a traces <<< "$TRACES"; else traces=("$ROOT"/ngramrl/traces/*.jsonl.gz); fi
if [ -n "${STEP_TRACES:-}" ]; then
    read -r -a step_traces <<< "$STEP_TRACES"
else
    step_traces=("$ROOT/ngramrl/traces/gsm-smollm2-t0.6.jsonl.gz")
fi
CORES=$(nproc 2>/dev/null || echo 1)
JOBS=${JOBS:-$(( CORES > 3 ? CORES - 2 : 1 ))}
STEP_BATCHES=${STEP_BATCHES:-256 1024}
STEP_THREADS=${STEP_THREADS:-1 2 8}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
PROGRESS="$OUT/progress.txt"
: > "$PROGRESS"
STAGE="start"
START=$(date +%s)

stage() {
    STAGE=$1
    echo "$(( $(date +%s) - START )) s: $STAGE" | tee -a "$PROGRESS"
}

finish() {
    local code=$?
    if [ "$STAGE" != "done" ]; then
        echo "gpu_check: stopped during '$STAGE' after $(( $(date +%s) - START )) s (exit $code)." \
             "Finished so far: $(cd "$OUT" && ls | tr '\n' ' ')" | tee -a "$PROGRESS" >&2
    fi
}
trap finish EXIT
trap 'exit 130' INT TERM

stage "environment"
"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        print(f"device {i}: {torch.cuda.get_device_name(i)}, {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
except ImportError as err:
    print("no torch:", err)
import numpy
print("numpy", numpy.__version__)
import os
print("cpus", os.cpu_count())
EOF
grep -m1 "model name" /proc/cpuinfo >> "$OUT/env.txt" 2>/dev/null
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv \
        >> "$OUT/env.txt" 2>&1
fi

stage "native drafting core (at most ${BUILD_BUDGET_S} s)"
# built in place in this checkout; a core already there, built from these sources for this Python, is kept
if ! "$PY" -c "import sys; from ngramrl.core.extension import native_module; sys.exit(native_module() is None)" \
        2>/dev/null; then
    (cd "$ROOT" && timeout "$BUILD_BUDGET_S" "$PY" setup.py -q build_ext --inplace) >> "$OUT/env.txt" 2>&1 \
        || echo "gpu_check: building the native core failed or ran out of time" | tee -a "$OUT/env.txt" >&2
fi
"$PY" - >> "$OUT/env.txt" 2>&1 <<'EOF'
from ngramrl.core.batch import native_module
print("drafting core:", "native" if native_module() is not None else
      "the Python reference (ngramrl._native did not build here; the drafting times are the reference's)")
EOF
cat "$OUT/env.txt"

quick=()
[ "$QUICK" = "1" ] && quick=(--quick)

stage "measured step profile of $MODEL on $DEVICE (at most ${PROFILE_BUDGET_S} s of measuring)"
# the measuring stops itself at its budget; the outer limit adds room for building the model
timeout $(( PROFILE_BUDGET_S + 60 )) "$PY" -m ngramrl.cli profile-gpu --model "$MODEL" --device "$DEVICE" \
    "${quick[@]}" --time-budget-s "$PROFILE_BUDGET_S" --progress --out "$OUT/profile.json" \
    > "$OUT/profile.log" 2>&1
code=$?
tail -n 3 "$OUT/profile.log"
if [ $code -ne 0 ] || [ ! -s "$OUT/profile.json" ]; then
    echo "gpu_check: the measured profile failed (exit $code); see $OUT/profile.log" | tee -a "$PROGRESS" >&2
    exit 1
fi

stage "roofline profile of $MODEL on an H200, beside the measured one"
"$PY" -m ngramrl.cli profile-gpu --model "$MODEL" --roofline h200 --out "$OUT/roofline.json" >> "$OUT/profile.log" 2>&1

failed=""

stage "drafting step times on this CPU at batches $STEP_BATCHES, threads $STEP_THREADS (at most ${STEPS_BUDGET_S} s)"
# every row drafts k tokens (--draft-always): the most the proposer costs per step; the forward's
# length, the prefetch's window, is the measured profile's; the text goes to the profile's log
# shellcheck disable=SC2086
timeout "$STEPS_BUDGET_S" "$PY" -m ngramrl.cli bench-steps "${step_traces[@]}" --batch $STEP_BATCHES \
    --threads $STEP_THREADS --draft-always --profile "$OUT/profile.json" --json "$OUT/bench_steps.json" \
    2>&1 | tee -a "$OUT/profile.log"
code=${PIPESTATUS[0]}
if [ "$code" -ne 0 ]; then
    echo "gpu_check: the drafting step times stopped (exit $code); going on" | tee -a "$PROGRESS" >&2
    failed="$failed bench-steps"
fi

stage "projection of ${#traces[@]} traces at engine batches $BATCHES, $JOBS at a time (at most ${PROJECT_BUDGET_S} s)"
# shellcheck disable=SC2086
timeout "$PROJECT_BUDGET_S" "$PY" -m ngramrl.cli project "${traces[@]}" --profile "$OUT/profile.json" \
    --engine-batch $BATCHES --method $METHODS --jobs "$JOBS" --json "$OUT/projection.json" 2>&1 \
    | tee "$OUT/projection.txt"
code=${PIPESTATUS[0]}
if [ "$code" -ne 0 ]; then
    echo "gpu_check: the projection stopped (exit $code); the runs finished are in $OUT/projection.json" \
        | tee -a "$PROGRESS" >&2
    exit 1
fi
if [ -n "$failed" ]; then
    STAGE="done"
    echo "gpu_check: finished in $(( $(date +%s) - START )) s, but these stages failed:$failed" | tee -a "$PROGRESS" >&2
    exit 1
fi

stage "done"
echo "gpu_check: finished in $(( $(date +%s) - START )) s; results in $OUT" | tee -a "$PROGRESS"
