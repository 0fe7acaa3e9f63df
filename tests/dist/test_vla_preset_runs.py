"""The VLA presets (experiment=aloha_pi0_tiny, aloha_pi05_tiny, aloha_smolvla_tiny) sharded on real ranks: FSDP-2
for each, HSDP-2x2 for pi0.5, each joint layer one unit. A run of 4 steps with sharded checkpoints (DCP) every 2;
a copy resumed at step 2 ends bit-identical to it (weights, optimizer state, RNG streams, schedules) after the same
samples; lerobot-mg-convert-dcp merges both final checkpoints into the same model.safetensors, which loads strictly
as the policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import convert_checkpoint
from lerobot_mg.peft.lora import load_policy
from tests.dist.test_checkpoints import copy_run
from tests.dist.test_resume import assert_same_checkpoint, assert_tensors_equal, resume_args, update_digests
from tests.launch_utils import run_train
from tests.vla_preset_aids import PRESET_TEST_OVERRIDES, VLA_PRESETS, shared_vla_dataset

pytestmark = pytest.mark.dist

STEPS = 4
SAVE_FREQ = 2
# The same global batch of 4 on either layout.
LAYOUTS: dict[str, tuple[int, list[str], str]] = {
    "fsdp2": (2, ["parallelism.dp_shard=2", "batch_size=2"], "topology: FSDP2: 2 shards (world size 2)"),
    "hsdp2x2": (4, ["parallelism.dp_replicate=2", "parallelism.dp_shard=2", "batch_size=1"],
                "topology: HSDP: 2 replicas x 2 shards (mesh dp_replicate x dp_shard) (world size 4)"),
}
POLICY_CLASSES = {"aloha_pi0_tiny": "PI0Policy", "aloha_pi05_tiny": "PI05Policy",
                  "aloha_smolvla_tiny": "SmolVLAPolicy"}
CASES = [*((preset, "fsdp2") for preset in VLA_PRESETS), ("aloha_pi05_tiny", "hsdp2x2")]


@pytest.fixture(scope="module")
def vla_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_vla_dataset(tmp_path_factory)


@pytest.mark.parametrize(("preset", "layout"), CASES)
def test_a_sharded_vla_preset_resumes_bit_exact_and_converts(preset: str, layout: str, vla_dataset: Path,
                                                              tmp_path: Path) -> None:
    nproc, overrides, topology = LAYOUTS[layout]
    reference = tmp_path / "reference"
    proc = run_train([f"experiment={preset}", "dataset=lerobot", f"dataset.root={vla_dataset}",
                      *PRESET_TEST_OVERRIDES, *overrides, f"steps={STEPS}", f"checkpoint.save_freq={SAVE_FREQ}",
                      "checkpoint.format=dcp", f"output_dir={reference}"], nproc=nproc, timeout=360)
    assert topology in proc.stdout
    assert "joint units: 2 (" in proc.stdout or "joint units: 4 (" in proc.stdout, proc.stdout[-3000:]

    resumed = copy_run(reference, tmp_path / "resumed")
    proc = run_train(resume_args(resumed, SAVE_FREQ), nproc=nproc, timeout=360)
    assert f"sample offset {SAVE_FREQ * 4}" in proc.stdout
    final = L.step_dir_name(STEPS)
    assert_same_checkpoint(L.checkpoints_root(resumed) / final, L.checkpoints_root(reference) / final)
    digests = update_digests(resumed, SAVE_FREQ)
    assert len(digests) == STEPS - SAVE_FREQ and digests == update_digests(reference, SAVE_FREQ)

    # checkpoint.format=dcp wrote shards only; the converter merges each run's into the same loadable file.
    merged = [convert_checkpoint(L.checkpoints_root(run) / final) for run in (reference, resumed)]
    weights = load_file(str(merged[0]))
    assert_tensors_equal(load_file(str(merged[1])), weights, "converted weights")
    policy = load_policy(merged[0].parent)
    assert type(policy).__name__ == POLICY_CLASSES[preset]
    state = policy.state_dict()
    assert state.keys() == weights.keys()
    for key, tensor in weights.items():
        assert torch.equal(state[key], tensor), key
    # Trained: the weights moved from those of step 2.
    start = L.checkpoints_root(reference) / L.step_dir_name(SAVE_FREQ)
    start_weights = load_file(str(convert_checkpoint(start)))
    assert any(not torch.equal(start_weights[key], tensor) for key, tensor in weights.items())
