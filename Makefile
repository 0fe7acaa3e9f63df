# Two commands do all set-up on a fresh machine: `make train` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lerobot_mg-setup
PYTEST_ARGS ?=
# Where dataset=embedded looks (conf/dataset/embedded.yaml): $LEROBOT_MG_CACHE or ~/.cache/lerobot_mg.
EMBEDDED_ROOT ?= $${LEROBOT_MG_CACHE:-$$HOME/.cache/lerobot_mg}/datasets/aloha_transfer_cube

.PHONY: setup lock test-latest test-matrix test-kernels gpu-check-prepare gpu-check-rehearse train train-image train-vla train-diffusion test test-fast bench lint clean-outputs slurm-local slurm-local-stop

# The versions CI tested, pinned with hashes (make lock writes it): every package but torch, extras included.
LOCK := requirements/lock.txt
# torch, installed first and by itself: `pip install torch==2.13.0` takes the CUDA build from PyPI on Linux (what a
# GPU machine wants) and keeps a torch already in the venv. For the CPU build on a CPU-only machine, put it in first:
#   python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
TORCH_VERSION ?= 2.13.0

# torch, then exactly the lock (--no-deps: nothing is resolved, so nothing newer and no other torch comes in), then
# this package in editable mode, built with the lock's setuptools; pip check then confirms the set is consistent.
setup: $(STAMP)
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==$(TORCH_VERSION)
	$(PY) -m pip install --no-deps --require-hashes -r $(LOCK)
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $(STAMP)

# Re-pin requirements/lock.txt from pyproject.toml's ranges (after changing one; `--upgrade` moves every pin to the
# newest allowed: make lock LOCK_ARGS=--upgrade). uv resolves for every platform, for Python 3.11, against the CPU
# build of torch, whose dependencies every build shares (the CUDA build's nvidia-* packages stay out), and leaves
# torch itself out. TORCH_CPU_SOURCE says where that build is: a folder of wheels (the default: where the CI
# machines keep it), or PyTorch's CPU index (--index https://download.pytorch.org/whl/cpu).
UV_VERSION ?= 0.13.9
TOOLS_VENV ?= .venv-tools
TORCH_CPU_SOURCE ?= --find-links /opt/wheels
LOCK_ARGS ?=
lock:
	test -x $(TOOLS_VENV)/bin/uv || { python3 -m venv $(TOOLS_VENV) && $(TOOLS_VENV)/bin/pip install uv==$(UV_VERSION); }
	$(TOOLS_VENV)/bin/uv pip compile pyproject.toml --extra sim --extra dev --extra trackio --universal \
	    --python-version 3.11 --generate-hashes --no-emit-package torch --override <(echo torch==$(TORCH_VERSION)+cpu) \
	    $(TORCH_CPU_SOURCE) --custom-compile-command "make lock" --quiet $(LOCK_ARGS) -o $(LOCK)

# The main job: generate the embedded ALOHA transfer-cube demos once (cached), train a state-only ACT
# (experiment=aloha_state), evaluate it in simulation. About 7 minutes on 2 CPU cores, demos included.
train: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)" num_episodes=50
	$(PY) scripts/train.py experiment=aloha_state

# ACT with the top camera (experiment=aloha_image) on 10 demos with 240x320 video: on a CPU, a throughput check.
train-image: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)_images" num_episodes=10 image_size="[240,320]"
	$(PY) scripts/train.py experiment=aloha_image

# pi0, pi0.5 or SmolVLA at CPU size (experiment=aloha_<VLA>_tiny) on the image demos with the task's instruction,
# evaluated in simulation: make train-vla VLA=pi0 (or pi05, smolvla).
VLA ?= smolvla
train-vla: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)_images" num_episodes=10 image_size="[240,320]"
	$(PY) scripts/train.py experiment=aloha_$(VLA)_tiny

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

# The suite against the newest versions pyproject.toml's ranges allow, in a venv of its own (.venv-latest; .venv
# keeps the lock's): the same torch as `make setup`, everything else resolved now. It prints what moved since the
# lock first. Run it to see whether `make lock LOCK_ARGS=--upgrade` is safe (LATEST_TESTS: which tests to run).
LATEST_VENV ?= .venv-latest
LATEST_TESTS ?= tests
LATEST_PY := $(LATEST_VENV)/bin/python
test-latest:
	test -x $(LATEST_PY) || python3 -m venv $(LATEST_VENV)
	$(LATEST_PY) -c "import torch" 2>/dev/null || $(LATEST_PY) -m pip install torch==$(TORCH_VERSION)
	$(LATEST_PY) -m pip install --upgrade --upgrade-strategy eager -e ".[sim,dev,trackio]" \
	    "torch==$$($(LATEST_PY) -c 'import torch; print(torch.__version__)')"
	$(LATEST_PY) scripts/lock_moved.py $(LOCK)
	OMP_NUM_THREADS=1 $(LATEST_PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile $(LATEST_TESTS) $(PYTEST_ARGS)

# The unit suite and the 1- and 2-rank distributed tests on the other Python/torch pairs the project claims: Python
# 3.12 + torch 2.11.0 (the GPU image's pair) and Python 3.13 + torch 2.14.1, each in an ignored venv of its own
# (.venv-matrix-*, several GB each: torch's CUDA build). Not in CI. MATRIX_PAIR=py312-torch2.11.0 runs one pair;
# each pair's summary lands in outputs/test_matrix/<pair>/summary.txt.
MATRIX_PAIR ?=
test-matrix:
	scripts/test_matrix.sh $(MATRIX_PAIR)

# The numeric unit tests again under the kernels other CPUs choose (MKL's Intel code paths, AVX2 and scalar ATen,
# oneDNN capped at AVX2, two threads), so a bit-exact comparison that only holds on this CPU fails here
# (tests/README.md states the rule). Not in CI: `make test` is one CPU's kernels; this is the others'.
test-kernels: setup
	scripts/test_kernels.sh $(PYTEST_ARGS)

# The GPU check (docs/gpu.md): the wheels the lent GPU machine lacks, into .whl/ (carried by the device call), and
# its rehearsal on this CPU in .venv-gpu-image/, a venv with the GPU image's versions (CUDA parts: "skipped: no GPU").
gpu-check-prepare:
	bash scripts/prepare_gpu_check.sh

gpu-check-rehearse: gpu-check-prepare
	bash scripts/gpu_image_venv.sh
	PY=.venv-gpu-image/bin/python bash scripts/gpu_check.sh

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
