"""A LeRobot 0.6.1 pretrained_model/ as the base of a sharded fine-tune (FSDP-2 on real gloo process groups).

The base is the act_state fixture (tests/fixtures/lerobot_0_6_1) as tests/unit/test_lerobot_format.py lays it out;
the dataset has the fixture's features. Every rank loads the base strictly before sharding, and the gathered
checkpoint is LeRobot's again: the base's config.json fields and state_dict names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch_utils import run_train
from tests.unit.test_lerobot_format import FINETUNE, lerobot_base, manifest, write_fixture_dataset

pytestmark = pytest.mark.dist


def test_fsdp2_fine_tune_of_a_lerobot_base(tmp_path: Path) -> None:
    base = lerobot_base(tmp_path / "base" / "pretrained_model")
    dataset = write_fixture_dataset(tmp_path / "dataset")
    run_dir = tmp_path / "run"
    run_train([*FINETUNE, f"dataset.root={dataset}", f"policy.path={base}", "parallelism.dp_shard=2",
               f"output_dir={run_dir}"], nproc=2)
    pretrained = run_dir / "checkpoints" / "last" / "pretrained_model"
    ours = json.loads((pretrained / "config.json").read_text())
    assert ours == {**json.loads((base / "config.json").read_text()), "pretrained_path": str(base), "push_to_hub": True}
    trained, start = load_file(str(pretrained / "model.safetensors")), load_file(str(base / "model.safetensors"))
    assert manifest(trained) == manifest(start)
    assert any(not torch.equal(trained[key], start[key]) for key in start)
