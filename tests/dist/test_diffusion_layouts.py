"""Diffusion Policy on every layout, checkpoint format, resume and the converter, with activation checkpointing
composed with DDP and FSDP2: each run matches one process that trains on the same global batches without
checkpointing.

What makes a diffusion run comparable across layouts at all: each sample draws its timestep and noise from its
own seed (a function of the run seed, the epoch and the frame), so a sample gets the same noise whichever rank
or micro-batch carries it. Four launches serve every test here (``diffusion_run`` trains each once per module):

- ``single``: 1 process, batch 8, ``checkpoint.format=safetensors``, no activation checkpointing (the reference);
- ``ddp``: DDP-2, batch 4 per rank, activation checkpointing;
- ``fsdp``: FSDP-2 with units chosen by size (the U-Net declares none), activation checkpointing,
  ``checkpoint.format=dcp`` (shards only: the converter makes the weights loadable);
- ``hsdp_resumed``: the ``fsdp`` run resumed at step 3 on HSDP 2x2 (batch 2 per rank, the same global batch),
  ``checkpoint.format=safetensors_dcp``.

Tolerances are the layout tests' (tests/tolerances.py), and the one-process reference runs on the other SIMD
kernel as there.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import convert_checkpoint, read_dcp_tensors
from lerobot_mg.peft.lora import load_policy
from tests.dist.conftest import OTHER_KERNEL, Run
from tests.dist.test_layouts import LR, NUM_UPDATES
from tests.launch_utils import run_train
from tests.tolerances import assert_same_series, assert_same_weights

pytestmark = pytest.mark.dist

MIN_NUM_PARAMS = 20_000  # the pusht_debug_diffusion U-Net (0.26M parameters): 9 units, the largest the U-Net itself
RESUME_STEP = 3
DIFFUSION_RUN = [
    "experiment=pusht_debug_diffusion",
    "logging.progress_bar=false",
    "logging.wandb.mode=disabled",
    f"steps={NUM_UPDATES}",
    "log_freq=1",
    f"checkpoint.save_freq={RESUME_STEP}",
    f"optimizer.lr={LR}",
]
RUNS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["batch_size=8"]),
    "ddp": (2, ["batch_size=4", "accelerator.activation_checkpointing=true"]),
    "fsdp": (2, ["batch_size=4", "parallelism.dp_shard=2", f"accelerator.fsdp.min_num_params={MIN_NUM_PARAMS}",
                 "accelerator.activation_checkpointing=true", "checkpoint.format=dcp"]),
}


@pytest.fixture(scope="module")
def diffusion_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """``diffusion_run(name)`` -> the finished run (trained on first use; ``hsdp_resumed`` resumes a copy of
    ``fsdp``)."""
    root = tmp_path_factory.mktemp("diffusion")
    finished: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name in finished:
            return finished[name]
        output_dir = root / name
        if name == "hsdp_resumed":
            shutil.copytree(get("fsdp").output_dir, output_dir, symlinks=True)
            config = L.checkpoints_root(output_dir) / L.step_dir_name(RESUME_STEP) / L.PRETRAINED_MODEL_DIR
            proc = run_train(
                ["resume=true", f"config_path={config / L.TRAIN_CONFIG_JSON}", "parallelism.dp_replicate=2",
                 "parallelism.dp_shard=2", "batch_size=2", "checkpoint.format=safetensors_dcp"],
                nproc=4, timeout=240,
            )
        else:
            nproc, overrides = RUNS[name]
            proc = run_train([*DIFFUSION_RUN, *overrides, f"output_dir={output_dir}"], nproc=nproc, timeout=180,
                             env=OTHER_KERNEL if name == "single" else None)
        finished[name] = Run(output_dir, proc.stdout)
        return finished[name]

    return get


def _series(run: Run, key: str, after_step: int) -> list[float]:
    return [record[key] for record in run.metrics() if record["step"] > after_step]


def _assert_matches_one_process(run: Run, single: Run, after_step: int = 0,
                                weights: dict[str, torch.Tensor] | None = None) -> None:
    """Loss and gradient norm at every logged step after ``after_step`` (the k-th computed after k - 1 updates),
    then the final weights (``weights``, or the run's model.safetensors)."""
    steps = [record["step"] for record in single.metrics() if record["step"] > after_step]
    assert [record["step"] for record in run.metrics() if record["step"] > after_step] == steps
    for key in ("loss", "grad_norm"):
        assert_same_series(_series(run, key, after_step), _series(single, key, after_step),
                           [step - 1 for step in steps], key)
    # The loss moved: six different noise draws and updates, not one number six times.
    assert len({round(value, 4) for value in _series(single, "loss", 0)}) == NUM_UPDATES
    assert_same_weights(run.weights() if weights is None else weights, single.weights(), NUM_UPDATES, LR)


def test_ddp_with_activation_checkpointing_matches_one_process(diffusion_run: Callable[[str], Run]) -> None:
    run, single = diffusion_run("ddp"), diffusion_run("single")
    assert "topology: DDP: 2 replicas (world size 2)" in run.stdout
    # DDP has no wrap units: the policy's declared blocks are recomputed (2 levels x 2 + 2 middle + 1 x 2 up).
    assert "activation checkpointing: 8 modules, e.g. diffusion.unet.up_modules.0.1" in run.stdout
    _assert_matches_one_process(run, single)


def test_fsdp_by_size_with_activation_checkpointing_and_dcp_matches_one_process(
    diffusion_run: Callable[[str], Run],
) -> None:
    run, single = diffusion_run("fsdp"), diffusion_run("single")
    assert "topology: FSDP2: 2 shards (world size 2)" in run.stdout
    assert f"FSDP wrap units (accelerator.fsdp.min_num_params={MIN_NUM_PARAMS}): 9 units, e.g. diffusion.unet" in run.stdout
    # checkpoint.format=dcp wrote shards only; the converter merges them into the loadable file.
    final = L.checkpoints_root(run.output_dir) / L.step_dir_name(NUM_UPDATES)
    pretrained = final / L.PRETRAINED_MODEL_DIR
    assert not (pretrained / L.MODEL_SAFETENSORS).exists()
    _assert_matches_one_process(run, single, weights=load_file(str(convert_checkpoint(final))))
    policy = load_policy(pretrained)
    assert type(policy).__name__ == "DiffusionPolicy" and policy.config.down_dims == [32, 64]


def test_resume_on_hsdp_matches_one_process(diffusion_run: Callable[[str], Run]) -> None:
    """FSDP-2 DCP shards, resharded onto HSDP 2x2 at step 3: steps 4-6 on four ranks train as one process."""
    run, single = diffusion_run("hsdp_resumed"), diffusion_run("single")
    assert "topology: HSDP: 2 replicas x 2 shards (mesh dp_replicate x dp_shard) (world size 4)" in run.stdout
    assert f"Data sampler resumed global-batch-exact at epoch 0, sample offset {RESUME_STEP * 8}" in run.stdout
    _assert_matches_one_process(run, single, after_step=RESUME_STEP)
    # safetensors_dcp: the gathered file and the HSDP shards hold the same tensors.
    final = L.checkpoints_root(run.output_dir) / L.step_dir_name(6) / L.PRETRAINED_MODEL_DIR
    shards = read_dcp_tensors(final / L.MODEL_DCP_DIR)
    for key, tensor in load_file(str(final / L.MODEL_SAFETENSORS)).items():
        assert torch.equal(shards[key], tensor), key
