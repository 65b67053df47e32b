#!/usr/bin/env bash
# The GPU check (docs/gpu.md): a step profile of a Qwen3-8B shape measured on this machine's GPU,
# then the projection of the shipped traces through it at engine batches 1, 32, 128 and 512.
#
#     bash scripts/gpu_check.sh OUTDIR
#
# Needs only Python with PyTorch and numpy (no vLLM, no network, ngramrl not installed: it runs
# from this checkout). Writes a few small files to OUTDIR: env.txt, profile.json (+ .log),
# projection.json (+ .txt), roofline.json, progress.txt. Each stage has a time limit, so the
# whole check ends within about 10 minutes; if it is stopped, progress.txt and the last lines it
# prints say how far it got, and what was finished is already in OUTDIR.
#
# Settings (environment): MODEL (qwen3-8b), DEVICE (cuda), QUICK (0; 1 for the small grid),
# PROFILE_BUDGET_S (270), PROJECT_BUDGET_S (270), BATCHES ("1 32 128 512"), TRACES (the shipped
# ones), METHODS ("none pld suffix ngramrl ngramrl-prefetch"; suffix is skipped, saying so, where
# arctic-inference is not installed), PYTHON (python3).
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
PROFILE_BUDGET_S=${PROFILE_BUDGET_S:-270}
PROJECT_BUDGET_S=${PROJECT_BUDGET_S:-270}
BATCHES=${BATCHES:-1 32 128 512}
METHODS=${METHODS:-none pld suffix ngramrl ngramrl-prefetch}
TRACES=${TRACES:-$(ls "$ROOT"/ngramrl/traces/*.jsonl.gz)}
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
from ngramrl.core.batch import native_module
print("drafting core:", "native" if native_module() is not None else
      "the Python reference (ngramrl._native is not built here; the projection's drafting times are the reference's)")
EOF
cat "$OUT/env.txt"

quick=()
[ "$QUICK" = "1" ] && quick=(--quick)

stage "measured step profile of $MODEL on $DEVICE (at most ${PROFILE_BUDGET_S} s of measuring)"
# the measuring stops itself at its budget; the outer limit adds room for building the model
timeout $(( PROFILE_BUDGET_S + 120 )) "$PY" -m ngramrl.cli profile-gpu --model "$MODEL" --device "$DEVICE" \
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

stage "projection of $(echo $TRACES | wc -w) traces at engine batches $BATCHES (at most ${PROJECT_BUDGET_S} s)"
# shellcheck disable=SC2086
timeout "$PROJECT_BUDGET_S" "$PY" -m ngramrl.cli project $TRACES --profile "$OUT/profile.json" \
    --engine-batch $BATCHES --method $METHODS --json "$OUT/projection.json" 2>&1 | tee "$OUT/projection.txt"
code=${PIPESTATUS[0]}
if [ "$code" -ne 0 ]; then
    echo "gpu_check: the projection stopped (exit $code); the runs finished are in $OUT/projection.json" \
        | tee -a "$PROGRESS" >&2
    exit 1
fi

stage "done"
echo "gpu_check: finished in $(( $(date +%s) - START )) s; results in $OUT" | tee -a "$PROGRESS"
