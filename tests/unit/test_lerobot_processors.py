"""Processor files and numbers are LeRobot 0.6.1's, both ways, on the fixtures of tests/fixtures/lerobot_0_6_1.

In: our reader loads LeRobot's policy_{pre,post}processor files and gives LeRobot's normalised batch (``pre.*``) from
the raw one (``input.*``, camera frames through our uint8 -> [0, 1] step), and LeRobot's unnormalised actions from its
normalised chunk, bit for bit. Out: the processors we build from the fixture's dataset_stats.json (camera mean/std
replaced by ImageNet's, as LeRobot's training does) are written byte for byte as LeRobot wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.processors import (
    IMAGENET_STATS,
    NormalizerStep,
    load_processors,
    make_processors,
    with_imagenet_stats,
)
from lerobot_mg.step import to_device
from tests.tolerances import FLOAT32_ULPS, assert_close

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_0_6_1"
POLICIES = ["act_state", "act_image", "diffusion_image"]
UINT8_SUFFIX = ".uint8"


def _pretrained(name: str) -> Path:
    return FIXTURES / name / "pretrained_model"


def _reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "reference.safetensors"))


def _raw_batch(reference: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The fixture's raw batch as our DataLoader hands it over (cameras as uint8), and its camera keys."""
    batch = {key.removeprefix("input."): value for key, value in reference.items() if key.startswith("input.")}
    cameras = [key.removesuffix(UINT8_SUFFIX) for key in batch if key.endswith(UINT8_SUFFIX)]
    for camera in cameras:
        batch[camera] = batch.pop(camera + UINT8_SUFFIX)
    return batch, cameras


@pytest.mark.parametrize("name", [*POLICIES, "act_state_lora"])
def test_lerobot_processors_give_lerobots_numbers(name: str) -> None:
    reference = _reference(name)
    preprocessor, postprocessor = load_processors(_pretrained(name))
    raw, cameras = _raw_batch(reference)
    batch = to_device(raw, torch.device("cpu"), uint8_keys=cameras)
    for camera in cameras:  # our uint8 step is LeRobot's uint8.float() / 255 (lerobot_train.py)
        assert torch.equal(batch[camera], raw[camera].float() / 255)
    out = preprocessor(batch)
    normalised = [key.removeprefix("pre.") for key in reference if key.startswith("pre.")]
    assert "action" in normalised and "observation.state" in normalised
    for key in normalised:
        # float32 normalisation LeRobot's CPU computed (tests/README.md): its kernels' ulps
        assert_close(out[key], reference[f"pre.{key}"], **FLOAT32_ULPS, msg=key)
    if "observation.environment_state" in batch:  # ACT's default mapping has no ENV entry: unchanged
        assert torch.equal(out["observation.environment_state"], batch["observation.environment_state"])
    for camera in cameras:  # LeRobot stores no normalised frames: its rule, with ImageNet's statistics
        mean, std = (torch.tensor(IMAGENET_STATS[stat]) for stat in ("mean", "std"))
        assert torch.equal(out[camera], (batch[camera] - mean) / (std + 1e-8))
    prefixes = ["eval.", "merged.eval."] if name == "act_state_lora" else ["eval."]
    for prefix in prefixes:
        actions = postprocessor({"action": reference[f"{prefix}action_chunk"]})["action"]
        assert_close(actions, reference[f"{prefix}action_chunk_unnormalized"], **FLOAT32_ULPS, msg=prefix)


@pytest.mark.parametrize("name", POLICIES)
def test_processors_built_from_the_dataset_stats_are_lerobots_files(name: str, tmp_path: Path) -> None:
    config = json.loads((_pretrained(name) / "config.json").read_text())
    stats = json.loads((FIXTURES / name / "dataset_stats.json").read_text())
    inputs, outputs = config["input_features"], config["output_features"]
    cameras = [key for key, spec in inputs.items() if spec["type"] == "VISUAL"]
    policy_cfg = SimpleNamespace(normalization_mapping=config["normalization_mapping"])  # the policy's, as saved
    preprocessor, postprocessor = make_processors(policy_cfg, inputs, outputs, with_imagenet_stats(stats, cameras),
                                                  device=config["device"])
    preprocessor.save_pretrained(tmp_path)
    postprocessor.save_pretrained(tmp_path)
    lerobots = sorted(path.name for path in _pretrained(name).glob("policy_*"))
    assert sorted(path.name for path in tmp_path.iterdir()) == lerobots
    for file_name in lerobots:
        assert (tmp_path / file_name).read_bytes() == (_pretrained(name) / file_name).read_bytes(), file_name


def test_the_lora_fixture_keeps_its_bases_processors() -> None:
    for file_name in sorted(path.name for path in _pretrained("act_state").glob("policy_*")):
        assert (_pretrained("act_state_lora") / file_name).read_bytes() == (
            _pretrained("act_state") / file_name).read_bytes()


def test_lerobots_files_round_trip_through_ours(tmp_path: Path) -> None:
    """Loaded and saved again, LeRobot's files come out unchanged (every statistic kept, the same JSON)."""
    preprocessor, postprocessor = load_processors(_pretrained("act_image"))
    assert preprocessor.step(NormalizerStep).state_dict()["observation.images.top.count"].shape == (1, 1, 1)
    preprocessor.save_pretrained(tmp_path)
    postprocessor.save_pretrained(tmp_path)
    for path in tmp_path.iterdir():
        assert path.read_bytes() == (_pretrained("act_image") / path.name).read_bytes(), path.name
