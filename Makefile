# Two commands do all set-up on a fresh machine: `make train` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lerobot_mg-setup
PYTEST_ARGS ?=
# Where dataset=embedded looks (conf/dataset/embedded.yaml): $LEROBOT_MG_CACHE or ~/.cache/lerobot_mg.
EMBEDDED_ROOT ?= $${LEROBOT_MG_CACHE:-$$HOME/.cache/lerobot_mg}/datasets/aloha_transfer_cube

.PHONY: setup train train-image train-diffusion test test-fast bench lint clean-outputs slurm-local slurm-local-stop

# torch first, then the package (whose own `torch>=2.6` is then satisfied). From PyPI on Linux
# `pip install torch==2.13.0` is the CUDA build, which a GPU machine wants; on a CPU-only machine install the CPU
# build first (a torch already in the venv is kept):
#   python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
setup: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[sim,dev,trackio]"
	touch $(STAMP)

# The main job: generate the embedded ALOHA transfer-cube demos once (cached), train a state-only ACT
# (experiment=aloha_state), evaluate it in simulation. About 7 minutes on 2 CPU cores, demos included.
train: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)" num_episodes=50
	$(PY) scripts/train.py experiment=aloha_state

# ACT with the top camera (experiment=aloha_image) on 10 demos with 240x320 video: on a CPU, a throughput check.
train-image: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)_images" num_episodes=10 image_size="[240,320]"
	$(PY) scripts/train.py experiment=aloha_image

# Diffusion Policy (experiment=aloha_diffusion) on the same embedded demos, state-only, evaluated in sim.
train-diffusion: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)" num_episodes=50
	$(PY) scripts/train.py experiment=aloha_diffusion

# The whole suite: real multi-process runs on gloo; the SLURM tests skip without a cluster (make slurm-local).
# Three pytest-xdist workers, one test file at a time each: on 2 cores the third keeps the CPUs busy while a test
# waits on its ranks, a disk sync or SLURM. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 3
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests $(PYTEST_ARGS)

# One-process tests only (no torchrun, no simulation).
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests/unit $(PYTEST_ARGS)

# Every benchmark (each prints its figures beside their goals and writes outputs/bench/<script>.json), then
# docs/benchmarks.md from those files.
bench: setup
	@for b in scripts/bench_*.py; do [ $$b = scripts/bench_report.py ] && continue; echo "== $$b"; $(PY) $$b || exit 1; done
	$(PY) scripts/bench_report.py

# Style (ruff) and the layers contract (.importlinter): imports point down the layers.
lint: setup
	$(PY) -m ruff check lerobot_mg scripts tests
	$(VENV)/bin/lint-imports --no-cache

# A real 2-node SLURM cluster on this machine (root; installs Debian's slurm + munge where missing; idempotent), to
# try `-m hydra/launcher=slurm` before a real cluster. The SLURM tests use it (in CI they fail without it).
slurm-local:
	scripts/slurm_local.sh start

slurm-local-stop:
	scripts/slurm_local.sh stop

clean-outputs:
	rm -rf outputs/train outputs/multirun outputs/compare
