#!/usr/bin/env bash
# Prepare, on a machine with a package registry, the wheels that scripts/gpu_check.sh installs on the lent GPU
# machine (no network there; its python3 is CPython 3.12 with torch, accelerate, transformers, huggingface_hub,
# safetensors, peft, numpy, pyarrow, pandas, pillow, ... already installed; docs/gpu.md).
#
#   bash scripts/prepare_gpu_check.sh          # writes .whl/ (ignored by git), about 6 MiB
#
# What that machine lacks and the check imports: Hydra (hydra-core, omegaconf, antlr4-python3-runtime), submitit and
# hydra-submitit-launcher (lerobot_mg/launch/plugins) and diffusers (Diffusion Policy's noise schedulers). The
# versions are requirements/lock.txt's (the tested ones, inside pyproject.toml's ranges). antlr4-python3-runtime is
# published as an sdist only: it is built into a wheel here (pure Python, py3-none-any). Every other dependency of
# these is already on that machine, so each is fetched with --no-deps. av and wandb stay out (40 MB and 23 MB for
# cp312): nothing the check runs imports them. The project itself travels as the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=${DEST:-.whl}
LIMIT_BYTES=$((16 * 1024 * 1024))  # the share of the 64 MiB working tree a device call may spend on wheels

# name==version, as requirements/lock.txt pins them.
lock_version() {
  local pin
  pin=$(grep -iE "^$1==" requirements/lock.txt | head -n 1 | sed 's/ .*//') || true
  [ -n "$pin" ] || { echo "prepare_gpu_check: $1 is not pinned in requirements/lock.txt" >&2; exit 1; }
  echo "$pin"
}
WHEELS=(hydra-core omegaconf submitit hydra-submitit-launcher diffusers)
SDIST_ONLY=(antlr4-python3-runtime)

rm -rf "$DEST"
mkdir -p "$DEST"
pins=()
for name in "${WHEELS[@]}"; do pins+=("$(lock_version "$name")"); done
# The device README's flags: a CPython 3.12 manylinux x86-64 machine (these wheels are all py3-none-any).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${pins[@]}"
for name in "${SDIST_ONLY[@]}"; do
  "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" "$(lock_version "$name")"
done

# One version of each, all present, and the total within the limit.
count=$(find "$DEST" -type f -name '*.whl' | wc -l)
expected=$(( ${#WHEELS[@]} + ${#SDIST_ONLY[@]} ))
[ "$count" -eq "$expected" ] || { echo "prepare_gpu_check: $count wheels in $DEST, expected $expected" >&2; exit 1; }
total=$(find "$DEST" -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
ls -l "$DEST"/*.whl | awk '{printf "  %9d  %s\n", $5, $NF}'
printf 'prepare_gpu_check: %d wheels, %.2f MiB in %s (limit 16 MiB)\n' "$count" "$(echo "$total / 1048576" | bc -l)" "$DEST"
[ "$total" -le "$LIMIT_BYTES" ] || { echo "prepare_gpu_check: $total bytes is over the 16 MiB limit" >&2; exit 1; }
