#!/usr/bin/env bash
# GPU check (never part of CI): what only a GPU can show, in under 8 minutes on one H200, written to
# $OUT/gpu_check.json (docs/gpu.md says how a session runs it on the lent GPU machine, and what each part measures).
#
#   bash scripts/prepare_gpu_check.sh     # here, once: the wheels the GPU machine lacks, into .whl/ (about 6 MiB)
#   bash scripts/gpu_check.sh             # there: python3 (its torch) + .whl/ installed into /tmp/site; no network
#   bash scripts/gpu_check.sh --only pi0_bf16,act_bf16     # some parts only (GPU_CHECK_ONLY=... does the same)
#
# PY picks the interpreter (default python3); when it cannot import Hydra, omegaconf, submitit and diffusers, the
# wheels in .whl/ are installed into $GPU_CHECK_SITE (default /tmp/site) with pip --no-index, and the repository
# itself is put on PYTHONPATH (nothing is installed into the interpreter). GPU_CHECK_BUDGET_S (default 430) is the
# driver's time budget: no part starts that would not end inside it, and the JSON is written after every part.
# Without CUDA the CUDA parts report "skipped: no GPU", the memory plans and a CPU-size rehearsal of the training
# runs take their place, and the script still exits 0 (a failed part is a finding in the JSON, not an exit status).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_check}
SITE=${GPU_CHECK_SITE:-/tmp/site}
mkdir -p "$OUT"
started=$SECONDS

fail_json() {  # message: the JSON a session still gets back when the check cannot start at all
  "$PY" -c 'import json, sys; json.dump({"schema": 1, "parts": {}, "status": "failed: " + sys.argv[1]}, open(sys.argv[2], "w"))' \
      "$1" "$OUT/gpu_check.json" 2>/dev/null || printf '{"schema": 1, "parts": {}, "status": "failed: %s"}\n' "$1" > "$OUT/gpu_check.json"
  echo "gpu_check: $1" >&2
  exit 1
}

if ! "$PY" -c "import hydra, omegaconf, submitit, diffusers" 2>/dev/null; then
  ls .whl/*.whl > /dev/null 2>&1 || fail_json "$PY lacks hydra/omegaconf/submitit/diffusers and .whl/ holds no wheels (run scripts/prepare_gpu_check.sh here, carry .whl)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || fail_json "pip could not install .whl/ into $SITE"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: installed $(ls .whl/*.whl | wc -l) wheels into $SITE in $((SECONDS - started)) s"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# No network there: the Hub is never asked (tokenizers and configs are local); wandb stays off; output unbuffered.
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
"$PY" scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
echo "gpu_check: ${SECONDS}s in all (exit $status)"
exit "$status"
