"""Fine-tuning a base on a dataset normalises with that dataset's statistics, as LeRobot's lerobot-train does,
unless dataset.use_base_stats keeps the base's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.processors.normalize import make_processors
from tests.launch_utils import PUSHT_SLICE, TINY_RUN, run_train
from tests.unit.test_config import VALID, _train_config
from tests.unit.test_peft import FEATURES_IN, FEATURES_OUT, _save_base

NORMALIZER = "policy_preprocessor_step_3_normalizer_processor.safetensors"
UNNORMALIZER = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"


@pytest.mark.parametrize("use_base_stats", [False, True])
def test_a_fine_tune_normalises_with_the_datasets_statistics(use_base_stats: bool, tmp_path: Path) -> None:
    base = _save_base(tmp_path / "base" / "pretrained_model")
    dataset_stats = json.loads((PUSHT_SLICE / "meta" / "stats.json").read_text())
    # The base was trained on another dataset: its statistics are the PushT slice's, shifted.
    base_stats = {key: {name: (torch.as_tensor(value, dtype=torch.float32) + 100.0).tolist()
                        for name, value in dataset_stats[key].items()} for key in ("observation.state", "action")}
    for pipeline in make_processors(_train_config(VALID).policy, FEATURES_IN, FEATURES_OUT, base_stats):
        pipeline.save_pretrained(base)
    run_dir = tmp_path / "run"
    run_train([*TINY_RUN, f"policy.path={base}", "steps=1", f"dataset.use_base_stats={str(use_base_stats).lower()}",
               f"output_dir={run_dir}"])
    saved = run_dir / "checkpoints" / "last" / "pretrained_model"
    expected = base_stats if use_base_stats else dataset_stats
    normalizer, unnormalizer = load_file(str(saved / NORMALIZER)), load_file(str(saved / UNNORMALIZER))
    for key in ("observation.state", "action"):
        for name in ("mean", "std", "min", "max"):
            want = torch.as_tensor(expected[key][name], dtype=torch.float32)
            assert torch.equal(normalizer[f"{key}.{name}"], want), (key, name)
    for name in ("mean", "std", "min", "max"):
        assert torch.equal(unnormalizer[f"action.{name}"], torch.as_tensor(expected["action"][name],
                                                                            dtype=torch.float32))
