# Two commands do all set-up on a fresh machine: `make train` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lerobot_mg-setup
PYTEST_ARGS ?=
# Where dataset=embedded looks (conf/dataset/embedded.yaml): $LEROBOT_MG_CACHE or ~/.cache/lerobot_mg.
EMBEDDED_ROOT ?= $${LEROBOT_MG_CACHE:-$$HOME/.cache/lerobot_mg}/datasets/aloha_transfer_cube

.PHONY: setup train train-image train-diffusion test test-fast bench lint clean-outputs slurm-local slurm-local-stop

# torch first: `pip install torch==2.13.0` takes the CPU build that lies on disk here; a plain `torch` requirement
# on a machine without torch would pull a multi-GB CUDA build. The package's own `torch>=2.6` is then satisfied.
setup: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[sim,dev]"
	touch $(STAMP)

# The main job: generate the embedded ALOHA transfer-cube demos once (cached), train a state-only ACT, evaluate
# it in simulation. 6 min 53 s on 2 idle CPU cores, demos included, 49/50 successes (README "The main job").
train: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)" num_episodes=50
	$(PY) scripts/train.py experiment=aloha_state

# ACT with the top camera: a throughput check on a CPU (10 demos with 240x320 video, ~1.5 min to generate).
train-image: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)_images" num_episodes=10 image_size="[240,320]"
	$(PY) scripts/train.py experiment=aloha_image

# Diffusion Policy on the same embedded demos (state-only, evaluated in sim). About 50 minutes on 2 CPU cores.
train-diffusion: setup
	$(PY) scripts/make_dataset.py root="$(EMBEDDED_ROOT)" num_episodes=50
	$(PY) scripts/train.py experiment=aloha_diffusion

# Two xdist workers, one test file at a time each: tests wait on process start-up and rendezvous much of the time.
# Runs shared across files are trained once per session (tests/launch_utils.py: shared_by_workers).
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests $(PYTEST_ARGS)

# One-process tests only (no torchrun, no simulation).
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests/unit $(PYTEST_ARGS)

bench: setup
	@for b in scripts/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

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
