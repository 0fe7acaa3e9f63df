#!/usr/bin/env bash
# Reruns the numeric unit tests with the kernels another CPU would choose, so that a test comparing bit-exactly
# against stored numbers or across two code paths fails here, not on a user's machine (tests/README.md: the rule).
#
# Each variant is one pytest run. What changes bits in torch 2.13 CPU (MKL 2024.2, oneDNN 3.12), measured:
# - MKL picks its kernels by CPU vendor: on AMD it runs its AVX2 code even where AVX-512 exists, on Intel the
#   AVX-512 code. MKL_CBWR=<branch>, MKL_ENABLE_INSTRUCTIONS=AVX512 and MKL_DEBUG_CPU_TYPE do not change that on
#   AMD; a library that answers MKL's "is this an Intel CPU?" (mkl_serv_intel_cpu_true) with yes, preloaded, does:
#   an AMD EPYC then gives, bit for bit, the float32 GEMM results an Intel Xeon gives (it reproduced the
#   65-of-1,920 one-ulp differences of SmolVLA's state token seen there). On Intel, MKL_ENABLE_INSTRUCTIONS=AVX2
#   gives the AVX2 kernels instead (it does nothing on AMD, already there).
# - ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's convolutions, bfloat16 GEMM), ATEN_CPU_CAPABILITY=avx2 (ATen's vectorised
#   elementwise kernels: softmax, GELU, SiLU, exp) and =default (ATen's scalar kernels: reductions, norms too),
#   MKL_CBWR=COMPATIBLE (MKL's generic GEMM): a CPU without AVX-512, or an older one.
# - OMP_NUM_THREADS=2: another split of parallel reductions (the suite runs with one thread).
# A probe of a few kernels runs first under each variant: one that moves none of them on this CPU is skipped
# (e.g. the Intel MKL variant on an Intel CPU), and the script fails if every variant is.
#
# Usage: scripts/test_kernels.sh [pytest args...]   (e.g. -x, -k smolvla; -n 2 for xdist workers). PY=... picks
# the interpreter; KERNEL_VARIANTS="OMP_NUM_THREADS=2;ATEN_CPU_CAPABILITY=avx2" runs only those (";"-separated,
# MKL_VENDOR=intel stands for the preloaded answer); KERNEL_PROBE_ONLY=1 only shows what each variant moves.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

# The unit tests that compute with models or compare numbers: the policies, their LeRobot references
# (tests/fixtures/lerobot_0_6_1), LoRA, EMA, conversion, the processors.
TESTS=(
    tests/unit/test_act.py
    tests/unit/test_diffusion.py
    tests/unit/test_pi0.py
    tests/unit/test_smolvla.py
    tests/unit/test_smolvla_fsdp.py
    tests/unit/test_vla_core.py
    tests/unit/test_vla_lora.py
    tests/unit/test_vla_processors.py
    tests/unit/test_vla_mixture_masks.py
    tests/unit/test_lerobot_act.py
    tests/unit/test_lerobot_diffusion.py
    tests/unit/test_lerobot_format.py
    tests/unit/test_lerobot_lora.py
    tests/unit/test_lerobot_processors.py
    tests/unit/test_peft.py
    tests/unit/test_ema.py
    tests/unit/test_convert.py
    tests/unit/test_processors.py
    tests/unit/test_layers.py
    tests/unit/test_finetune_stats.py
)

DEFAULT_VARIANTS=(
    "MKL_VENDOR=intel"                                       # an Intel CPU's MKL kernels (AVX-512 where present)
    "MKL_ENABLE_INSTRUCTIONS=AVX2"                           # on Intel: AMD's (AVX2) MKL kernels
    "MKL_VENDOR=intel MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"  # no AVX-512
    "MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default"  # generic and scalar kernels
    "OMP_NUM_THREADS=2"
)
if [ -n "${KERNEL_VARIANTS:-}" ]; then
    IFS=';' read -r -a VARIANTS <<< "$KERNEL_VARIANTS"
else
    VARIANTS=("${DEFAULT_VARIANTS[@]}")
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SHIM=""
if printf 'int mkl_serv_intel_cpu_true(void) { return 1; }\n' > "$WORK/mkl_intel.c" \
        && "${CC:-cc}" -shared -fPIC -O2 -o "$WORK/mkl_intel.so" "$WORK/mkl_intel.c" 2>/dev/null; then
    SHIM="$WORK/mkl_intel.so"
fi

# Hashes of a few kernels' outputs; a variant that changes none of them on this CPU would test nothing.
PROBE='
import hashlib, torch, torch.nn.functional as F
g = torch.Generator().manual_seed(0)
def r(*s): return torch.randn(*s, generator=g)
x, w = r(20, 960), r(96, 960)
out = {
    "linear": F.linear(x, w),
    "small_linear": F.linear(r(2, 12), r(64, 12)),
    "bmm": torch.bmm(r(4, 50, 64), r(4, 64, 50)),
    "conv1d": F.conv1d(r(2, 64, 16), r(128, 64, 5), padding=2),
    "conv2d": F.conv2d(r(2, 3, 32, 32), r(16, 3, 3, 3)),
    "bf16_linear": F.linear(r(20, 960).bfloat16(), r(96, 960).bfloat16()),
    "layer_norm": F.layer_norm(x, (960,)),
    "softmax": x.softmax(-1),
    "gelu": F.gelu(x, approximate="tanh"),
    "exp": x.exp(),
    "sums": torch.stack([r(300_007).sum() for _ in range(8)]),
}
for name, t in out.items():
    print(name, hashlib.sha1(t.float().contiguous().numpy().tobytes()).hexdigest()[:12])
'

# "A=1 B=2" -> the env assignments of a variant, MKL_VENDOR=intel turned into the preload.
assignments_of() {
    ASSIGNMENTS=()
    local word
    for word in $1; do
        if [ "$word" = "MKL_VENDOR=intel" ]; then
            [ -n "$SHIM" ] || return 1
            ASSIGNMENTS+=("LD_PRELOAD=$SHIM${LD_PRELOAD:+:$LD_PRELOAD}")
        else
            ASSIGNMENTS+=("$word")
        fi
    done
}
probe() { env OMP_NUM_THREADS=1 "$@" "$PY" -c "$PROBE"; }

BASE=$(probe) || { echo "test_kernels: the kernel probe failed with $PY"; exit 2; }
FAILED=()
RAN=0
START=$SECONDS
for variant in "${VARIANTS[@]}"; do
    if ! assignments_of "$variant"; then
        echo "=== $variant: skipped (no C compiler, \$CC, to build the preload)"
        continue
    fi
    moved=$(diff <(echo "$BASE") <(probe "${ASSIGNMENTS[@]}") | sed -n 's/^> \([a-z_0-9]*\) .*/\1/p' | tr '\n' ' ')
    if [ -z "$moved" ]; then
        echo "=== $variant: skipped (changes no kernel's result on this CPU)"
        continue
    fi
    echo "=== $variant (moves: $moved)"
    [ -n "${KERNEL_PROBE_ONLY:-}" ] && continue
    t0=$SECONDS
    RAN=$((RAN + 1))
    env OMP_NUM_THREADS=1 "${ASSIGNMENTS[@]}" "$PY" -m pytest -q -ra -p no:cacheprovider "${TESTS[@]}" "$@" \
        || FAILED+=("$variant")
    echo "=== $variant: $((SECONDS - t0)) s"
done
[ -n "${KERNEL_PROBE_ONLY:-}" ] && exit 0
echo "test_kernels: $RAN of ${#VARIANTS[@]} variants ran, in $((SECONDS - START)) s"
if [ "$RAN" -eq 0 ]; then
    echo "test_kernels: no variant changes a kernel's result on this CPU: nothing was tested"
    exit 1
fi
if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'test_kernels: failed under %s\n' "${FAILED[@]}"
    exit 1
fi
echo "test_kernels: passed under every variant that ran"
