#!/usr/bin/env bash
# The unit suite and the one-rank and 2-rank distributed tests on the other Python/torch pairs this project claims
# (`make test` covers the lock's: Python 3.11, torch 2.13). Each pair gets a venv of its own,
# .venv-matrix-py<XY>-torch<VERSION> (torch from the package index: the CUDA build with its nvidia-* packages,
# several GB; it imports and runs gloo on a CPU-only machine), then the lock's pins where they install on that
# Python, else pyproject.toml's ranges resolved now with that torch pinned.
#
#   scripts/test_matrix.sh                      # every pair below, one after the other
#   scripts/test_matrix.sh py312-torch2.11.0    # one pair (py313-torch2.14.1 for the other)
#   MATRIX_PYTEST_ARGS="-x" scripts/test_matrix.sh py313-torch2.14.1
#
# Per pair, outputs/test_matrix/<pair>/ gets install.log, freeze.txt (pip freeze), pytest.log and summary.txt
# (Python, torch, where the pins came from, pytest's closing line, wall seconds, date). Exit status: non-zero when
# any pair failed to install or to pass.
#
# Environment: MATRIX_INSTALL_ONLY=1 (set up the venvs, run nothing), MATRIX_WORKERS (pytest-xdist workers, default 2), MATRIX_PYTEST_ARGS (appended to pytest's),
# MATRIX_PYTHON_3_12 / MATRIX_PYTHON_3_13 (the interpreters; default: pyenv's newest of that minor, else
# python3.12 / python3.13 on PATH), MATRIX_OUT (default outputs/test_matrix).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

# pair -> Python minor version and torch release: the GPU image's pair, and the newest torch the index serves.
declare -A PAIR_PYTHON=([py312-torch2.11.0]=3.12 [py313-torch2.14.1]=3.13)
declare -A PAIR_TORCH=([py312-torch2.11.0]=2.11.0 [py313-torch2.14.1]=2.14.1)
ALL_PAIRS=(py312-torch2.11.0 py313-torch2.14.1)

WORKERS="${MATRIX_WORKERS:-2}"
OUT_ROOT="${MATRIX_OUT:-$REPO/outputs/test_matrix}"
LOCK="requirements/lock.txt"

# The distributed tests whose runs take one or two processes: the launched one-rank path, DDP and FSDP2 against
# one process, accumulation, DCP checkpoints and resume, their refusals, signals, launchers and teardown. Left out:
# the 4-rank runs (HSDP 2x2, named hsdp in their ids, and the resharding chain, which loads on 4), and the files
# that are minutes each on 2 cores and test this project's code more than torch's (VLA, PEFT, guide, mixture runs;
# SLURM and the local sweep need a cluster).
DIST_FILES=(
    tests/dist/test_one_rank.py
    tests/dist/test_layouts.py
    tests/dist/test_resume.py
    tests/dist/test_checkpoints.py
    tests/dist/test_dcp_safety_runs.py
    tests/dist/test_fsdp_options.py
    tests/dist/test_joint_units_ranks.py
    tests/dist/test_stop_signals.py
    tests/dist/test_signals.py
    tests/dist/test_launchers.py
    tests/dist/test_teardown.py
)
DIST_EXCLUDE='hsdp|resharding'

find_python() {  # find_python 3.12 -> the path of an interpreter of that minor version
    local minor="$1" var="MATRIX_PYTHON_${1/./_}" candidate
    if [[ -n "${!var:-}" ]]; then echo "${!var}"; return; fi
    local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
    candidate="$(ls -d "$pyenv_root"/versions/"$minor".*/bin/python3 2>/dev/null | sort -V | tail -1)"
    if [[ -n "$candidate" ]]; then echo "$candidate"; return; fi
    command -v "python$minor" || true
}

install_pair() {  # install_pair <pair> <venv> <python> <torch> <out>: torch, then the lock or the ranges
    local pair="$1" venv="$2" python="$3" torch="$4" out="$5" py="$2/bin/python"
    test -x "$py" || "$python" -m venv "$venv" || return 1
    if [[ "$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$torch" ]]; then
        "$py" -m pip install "torch==$torch" || return 1
    fi
    # The lock resolves for every Python from 3.11 on, for torch 2.13. Where a pin does not install here, the lock's
    # pins become constraints, less setuptools (torch 2.11 on Python >= 3.12 requires setuptools<82; the lock has
    # 84), for every extra that installs: on Python 3.13 not sim (labmaze, which dm_control needs, has no cp313
    # wheel and builds only with bazel; the sim tests skip). pyproject.toml's ranges, resolved now, come last.
    if [[ -f "$venv/.matrix-source" ]]; then
        :
    elif "$py" -m pip install --no-deps --require-hashes -r "$LOCK" \
            && "$py" -m pip install --no-deps --no-build-isolation -e . && "$py" -m pip check; then
        echo "lock ($LOCK), every extra" > "$venv/.matrix-source"
    else
        local constraints="$out/lock-constraints.txt" extras
        # The lock's requirement lines without their hashes (pip takes no hashes in a constraints file).
        sed -n -E 's/^([A-Za-z0-9._-]+==[^ ]+( ;[^\\]*)?) *\\?$/\1/p' "$LOCK" | grep -v '^setuptools==' > "$constraints"
        for extras in dev,sim,trackio dev,trackio dev; do
            echo "== the lock does not install as it is: [$extras] with its pins as constraints"
            if "$py" -m pip install -c "$constraints" -e ".[$extras]" "torch==$torch" && "$py" -m pip check; then
                echo "lock ($LOCK) as constraints (setuptools: torch's), extras [$extras]" > "$venv/.matrix-source"
                break
            fi
        done
        if [[ ! -f "$venv/.matrix-source" ]]; then
            echo "== nor as constraints: pyproject.toml's ranges, resolved now"
            "$py" -m pip install -e ".[dev]" "torch==$torch" && "$py" -m pip check || return 1
            echo "pyproject.toml ranges, extras [dev], resolved $(date -u +%F)" > "$venv/.matrix-source"
        fi
    fi
    "$py" -m pip freeze --exclude-editable > "$out/freeze.txt"
}

run_pair() {  # run_pair <pair>: install, then the tests; 0 when they pass
    local pair="$1" minor="${PAIR_PYTHON[$1]}" torch="${PAIR_TORCH[$1]}"
    local venv="$REPO/.venv-matrix-$pair" out="$OUT_ROOT/$pair" python
    mkdir -p "$out"
    python="$(find_python "$minor")"
    if [[ -z "$python" ]]; then
        echo "$pair: no Python $minor found (set MATRIX_PYTHON_${minor/./_})" | tee "$out/summary.txt"
        return 1
    fi
    echo "== $pair: $("$python" --version) at $python, torch $torch, venv $venv"
    if ! install_pair "$pair" "$venv" "$python" "$torch" "$out" > "$out/install.log" 2>&1; then
        tail -20 "$out/install.log"
        echo "$pair: install failed (see $out/install.log)" | tee "$out/summary.txt"
        return 1
    fi
    [[ -z "${MATRIX_INSTALL_ONLY:-}" ]] || { echo "$pair: installed ($(cat "$venv/.matrix-source"))"; return 0; }
    local py="$venv/bin/python" dist_ids start status line
    # The selected distributed tests by id (collected here so that -k does not reach into tests/unit).
    dist_ids="$("$py" -m pytest --collect-only -q "${DIST_FILES[@]}" 2>/dev/null | grep '::' | grep -v -E "$DIST_EXCLUDE")"
    start=$(date +%s)
    # shellcheck disable=SC2086  # the ids carry no spaces; MATRIX_PYTEST_ARGS is a list of words
    OMP_NUM_THREADS=1 "$py" -m pytest -q -ra -p no:cacheprovider -n "$WORKERS" --dist loadfile tests/unit $dist_ids \
        ${MATRIX_PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.log"
    status=${PIPESTATUS[0]}
    line="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?)\b.* in [0-9.]+s' "$out/pytest.log" | tail -1)"
    {
        echo "pair: $pair"
        echo "python: $("$py" -c 'import platform; print(platform.python_version())')"
        echo "torch: $("$py" -c 'import torch; print(torch.__version__)')"
        echo "packages: $(cat "$venv/.matrix-source")"
        echo "dist tests selected: $(wc -l <<< "$dist_ids")"
        echo "pytest: ${line:-no closing line} (exit $status)"
        echo "wall_s: $(( $(date +%s) - start ))"
        echo "date: $(date -u +%F)"
        echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
    } | tee "$out/summary.txt"
    return "$status"
}

pairs=("$@")
[[ ${#pairs[@]} -gt 0 ]] || pairs=("${ALL_PAIRS[@]}")
for pair in "${pairs[@]}"; do
    if [[ -z "${PAIR_TORCH[$pair]:-}" ]]; then
        echo "unknown pair '$pair': one of ${ALL_PAIRS[*]}" >&2
        exit 2
    fi
done
failed=()
for pair in "${pairs[@]}"; do
    run_pair "$pair" || failed+=("$pair")
done
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "test matrix: FAILED ${failed[*]}"
    exit 1
fi
echo "test matrix: passed ${pairs[*]}"
