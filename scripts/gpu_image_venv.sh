#!/usr/bin/env bash
# A venv that holds what the lent GPU machine's python3 holds (CPython 3.12, torch 2.11.0, torchvision 0.26.0,
# accelerate 1.15.0, transformers 5.17.0, huggingface_hub 1.33.0, safetensors 0.8.0, numpy 2.5.2, tokenizers 0.23.2,
# peft, and the image's pyarrow, pandas, pillow, psutil, ...: docs/gpu.md), and none of what it lacks (Hydra,
# omegaconf, antlr4, submitit, diffusers, av, wandb), to rehearse scripts/gpu_check.sh on a CPU:
#
#   bash scripts/gpu_image_venv.sh                 # .venv-gpu-image/ (ignored by git); about 5 GB, a few minutes
#   bash scripts/prepare_gpu_check.sh              # the wheels the check carries (.whl/)
#   PY=.venv-gpu-image/bin/python bash scripts/gpu_check.sh   # installs .whl/ into /tmp/site as on the machine
#
# torch: the CPU build where the configured package indexes serve 2.11.0+cpu, else PyPI's (the CUDA build, which
# also runs on a machine without a GPU). peft: the image does not say which release it has; this takes the one
# requirements/lock.txt pins. The image's other packages are taken at the lock's versions.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PY=${BASE_PY:-/root/.pyenv/versions/3.12.1/bin/python3}
VENV=${VENV:-.venv-gpu-image}
IMAGE=(accelerate==1.15.0 transformers==5.17.0 huggingface_hub==1.33.0 safetensors==0.8.0 numpy==2.5.2
       tokenizers==0.23.2 torchvision==0.26.0)
# Also in the image, at versions it does not state: the lock's.
FROM_LOCK=(peft pyarrow pandas pillow psutil filelock tqdm matplotlib pyyaml packaging regex requests httpx
           typing-extensions cloudpickle jinja2)

pin() { grep -iE "^$1==" requirements/lock.txt | head -n 1 | sed 's/ .*//'; }
[ -x "$VENV/bin/python" ] || "$BASE_PY" -m venv "$VENV"
PY="$VENV/bin/python"
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.11.0+cpu 2>/dev/null || "$PY" -m pip install -q torch==2.11.0
fi
locked=()
for name in "${FROM_LOCK[@]}"; do locked+=("$(pin "$name")"); done
"$PY" -m pip install -q "${IMAGE[@]}" "${locked[@]}" "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)"
# What the machine lacks must be missing here too, or the rehearsal proves nothing.
for absent in hydra omegaconf antlr4 submitit hydra_plugins diffusers av wandb lerobot_mg; do
  if "$PY" -I -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$absent') is None)" 2>/dev/null; then
    echo "gpu_image_venv: $absent is importable in $VENV, but the GPU machine lacks it" >&2
    exit 1
  fi
done
"$PY" -m pip list --format=freeze 2>/dev/null | grep -iE "^(torch|accelerate|transformers|huggingface.hub|safetensors|numpy|tokenizers|peft)=="
echo "gpu_image_venv: $VENV ready ($("$PY" --version))"
