"""Pre/post-processors: normalisation numbers, the other steps, round trips, file names on disk, errors.

That the files and numbers are LeRobot 0.6.1's (its fixtures) is tests/unit/test_lerobot_processors.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lerobot_mg.errors import ConfigError
from lerobot_mg.policies import features_from_dataset
from lerobot_mg.policies.act import ACTConfig
from lerobot_mg.processors import (
    IMAGENET_STATS,
    DeviceStep,
    NormalizerStep,
    PolicyProcessorPipeline,
    RenameObservationsStep,
    ToBatchStep,
    UnnormalizerStep,
    camera_keys,
    load_processors,
    make_processors,
    with_imagenet_stats,
)
from tests.launch_utils import PUSHT_SLICE

PUSHT_META = PUSHT_SLICE / "meta"

INPUTS = {
    "observation.state": {"type": "STATE", "shape": [2]},
    "observation.environment_state": {"type": "ENV", "shape": [3]},
    "observation.images.top": {"type": "VISUAL", "shape": [3, 4, 4]},
}
OUTPUTS = {"action": {"type": "ACTION", "shape": [2]}}
STATS = {
    "observation.state": {"mean": [1.0, -2.0], "std": [2.0, 0.5], "min": [-3.0, -4.0], "max": [5.0, 0.0]},
    "observation.environment_state": {
        "mean": [0.0, 0.0, 0.0],
        "std": [1.0, 1.0, 1.0],
        "min": [0.0] * 3,
        "max": [2.0] * 3,
    },
    # Images: per-channel statistics of shape (3, 1, 1), as LeRobot stores them.
    "observation.images.top": {
        "mean": torch.tensor([0.5, 0.4, 0.3]).reshape(3, 1, 1),
        "std": torch.tensor([0.2, 0.1, 0.25]).reshape(3, 1, 1),
    },
    "action": {"mean": [10.0, 20.0], "std": [5.0, 4.0], "min": [0.0, 10.0], "max": [20.0, 30.0]},
}


def config_with(**mapping: str) -> ACTConfig:
    base = {"VISUAL": "MEAN_STD", "STATE": "MEAN_STD", "ENV": "MEAN_STD", "ACTION": "MEAN_STD"}
    return ACTConfig(normalization_mapping={**base, **mapping})


def make_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "observation.state": torch.randn(4, 2, generator=generator) * 3,
        "observation.environment_state": torch.rand(4, 3, generator=generator),
        "observation.images.top": torch.rand(4, 3, 4, 4, generator=generator),
        "action": torch.randn(4, 7, 2, generator=generator) * 5 + 10,
        "action_is_pad": torch.zeros(4, 7, dtype=torch.bool),
        "task": ["push the T"] * 4,
    }


def test_mean_std_values() -> None:
    pre, _ = make_processors(config_with(), INPUTS, OUTPUTS, STATS)
    batch = {
        "observation.state": torch.tensor([[3.0, -1.5]]),
        "action": torch.tensor([[[15.0, 16.0]]]),
        "observation.images.top": torch.full((1, 3, 4, 4), 0.5),
    }
    out = pre(batch)
    torch.testing.assert_close(out["observation.state"], torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(out["action"], torch.tensor([[[1.0, -1.0]]]))
    torch.testing.assert_close(out["observation.images.top"][0, :, 0, 0], torch.tensor([0.0, 1.0, 0.8]))


def test_min_max_maps_range_to_minus_one_one() -> None:
    pre, post = make_processors(config_with(STATE="MIN_MAX", ACTION="MIN_MAX"), INPUTS, OUTPUTS, STATS)
    out = pre({"observation.state": torch.tensor([[-3.0, -4.0], [5.0, 0.0], [1.0, -2.0]])})
    torch.testing.assert_close(out["observation.state"], torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(
        post({"action": torch.tensor([[-1.0, 1.0]])})["action"], torch.tensor([[0.0, 30.0]])
    )


def test_a_type_missing_from_the_mapping_is_identity_and_a_zero_range_maps_to_minus_one() -> None:
    """LeRobot's rules: ACT's default mapping has no ENV entry (the environment state passes unchanged), and a
    MIN_MAX feature whose min equals its max divides by eps instead of zero."""
    mapping = {"VISUAL": "MEAN_STD", "STATE": "MIN_MAX", "ACTION": "MEAN_STD"}
    stats = {**STATS, "observation.state": {"min": [-3.0, 2.0], "max": [5.0, 2.0]}}
    pre, _ = make_processors(ACTConfig(normalization_mapping=mapping), INPUTS, OUTPUTS, stats)
    batch = make_batch()
    batch["observation.state"][:, 1] = 2.0
    out = pre(batch)
    assert out["observation.environment_state"] is batch["observation.environment_state"]
    assert torch.equal(out["observation.state"][:, 1], torch.full((4,), -1.0))
    restored = UnnormalizerStep(INPUTS, mapping, stats)(out)
    assert torch.equal(restored["observation.state"][:, 1], torch.full((4,), 2.0))


@pytest.mark.parametrize("mode", ["MEAN_STD", "MIN_MAX"])
def test_normalise_then_unnormalise_is_identity(mode: str) -> None:
    pre, post = make_processors(config_with(STATE=mode, ENV=mode, ACTION=mode), INPUTS, OUTPUTS, STATS)
    batch = make_batch()
    normalised = pre(batch)
    assert not torch.allclose(normalised["action"], batch["action"])
    torch.testing.assert_close(post({"action": normalised["action"]})["action"], batch["action"])
    restored = UnnormalizerStep(
        {**INPUTS, **OUTPUTS}, config_with(STATE=mode, ENV=mode, ACTION=mode).normalization_mapping, STATS
    )(normalised)
    for key in [*INPUTS, "action"]:
        torch.testing.assert_close(restored[key], batch[key])


def test_identity_missing_keys_and_non_tensors_pass_through() -> None:
    pre, _ = make_processors(config_with(ENV="IDENTITY"), INPUTS, OUTPUTS, STATS)
    batch = make_batch()
    del batch["action"]  # an inference batch
    original_state = batch["observation.state"].clone()
    out = pre(batch)
    assert "action" not in out
    assert out["task"] == ["push the T"] * 4
    assert out["observation.environment_state"] is batch["observation.environment_state"]
    assert torch.equal(out["action_is_pad"], batch["action_is_pad"])
    # The caller's batch is not modified in place.
    assert torch.equal(batch["observation.state"], original_state)


def test_zero_std_stays_finite() -> None:
    stats = {**STATS, "action": {"mean": [1.0, 1.0], "std": [0.0, 0.0]}}
    pre, post = make_processors(config_with(), INPUTS, OUTPUTS, stats)
    out = pre({"action": torch.ones(2, 3, 2)})
    assert torch.equal(out["action"], torch.zeros(2, 3, 2))
    torch.testing.assert_close(post(out)["action"], torch.ones(2, 3, 2))


def test_low_precision_inputs_are_computed_in_float32_and_device_move() -> None:
    pre, post = make_processors(config_with(), INPUTS, OUTPUTS, STATS)
    out = pre({"observation.state": torch.tensor([[3.0, -1.5]], dtype=torch.bfloat16)})
    assert out["observation.state"].dtype == torch.float32
    torch.testing.assert_close(out["observation.state"], torch.tensor([[1.0, 1.0]]))
    action = post({"action": torch.tensor([[1.0, -1.0]], dtype=torch.bfloat16)})["action"]
    assert action.dtype == torch.float32
    torch.testing.assert_close(action, torch.tensor([[15.0, 16.0]]))
    assert pre.to("cpu") is pre
    assert pre.to("meta") is pre
    assert pre.step(NormalizerStep).state_dict()["observation.state.mean"].device.type == "meta"
    assert pre.step(DeviceStep).get_config() == {"device": "meta", "float_dtype": None}


def test_save_and_load_file_names_and_results(tmp_path: Path) -> None:
    pre, post = make_processors(config_with(STATE="MIN_MAX", ENV="IDENTITY"), INPUTS, OUTPUTS, STATS)
    pre.save_pretrained(tmp_path)
    post.save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "policy_postprocessor.json",
        "policy_postprocessor_step_0_unnormalizer_processor.safetensors",
        "policy_preprocessor.json",
        "policy_preprocessor_step_3_normalizer_processor.safetensors",
    ]
    manifest = json.loads((tmp_path / "policy_preprocessor.json").read_text())
    assert manifest["name"] == "policy_preprocessor"
    assert [step["registry_name"] for step in manifest["steps"]] == [
        "rename_observations_processor", "to_batch_processor", "device_processor", "normalizer_processor"]
    assert ["state_file" in step for step in manifest["steps"]] == [False, False, False, True]
    assert manifest["steps"][3]["config"]["norm_map"]["STATE"] == "MIN_MAX"

    loaded_pre, loaded_post = load_processors(tmp_path)
    assert [type(step) for step in loaded_pre.steps] == [RenameObservationsStep, ToBatchStep, DeviceStep, NormalizerStep]
    assert [type(step) for step in loaded_post.steps] == [UnnormalizerStep, DeviceStep]
    batch = make_batch()
    expected, actual = pre(batch), loaded_pre(batch)
    for key in [*INPUTS, "action"]:
        assert torch.equal(actual[key], expected[key]), key
    assert torch.equal(
        loaded_post({"action": batch["action"]})["action"], post({"action": batch["action"]})["action"]
    )


def test_every_statistic_of_every_key_is_kept() -> None:
    """LeRobot's state files hold the whole stats.json (float32), a camera's 1-D statistics as (C, 1, 1), whatever
    the step normalises."""
    stats = {**STATS, "timestamp": {"min": [0.0], "max": [3.9], "count": [720]},
             "observation.images.top": {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.1, 0.25], "count": [720]}}
    pre, post = make_processors(config_with(), INPUTS, OUTPUTS, stats)
    state = pre.step(NormalizerStep).state_dict()
    assert {key for key in state} == {f"{key}.{name}" for key, per_key in stats.items() for name in per_key}
    assert {tensor.dtype for tensor in state.values()} == {torch.float32}
    assert state["observation.images.top.mean"].shape == (3, 1, 1)
    assert state["observation.images.top.count"].shape == (1, 1, 1) and state["timestamp.count"].tolist() == [720.0]
    # The postprocessor has no camera feature: LeRobot leaves that camera's count 1-D there.
    assert post.step(UnnormalizerStep).state_dict()["observation.images.top.count"].shape == (1,)


def test_the_batch_device_and_rename_steps() -> None:
    sample = {"observation.state": torch.zeros(2), "observation.images.top": torch.zeros(3, 4, 4),
              "action": torch.zeros(2), "index": torch.tensor(5), "task": "push", "action_is_pad": torch.zeros(1)}
    batched = ToBatchStep()(sample)
    assert {key: tuple(value.shape) for key, value in batched.items() if key != "task"} == {
        "observation.state": (1, 2), "observation.images.top": (1, 3, 4, 4), "action": (1, 2), "index": (1,),
        "action_is_pad": (1,)}
    assert batched["task"] == ["push"] and ToBatchStep()(batched)["observation.state"].shape == (1, 2)
    cast = DeviceStep("cpu", "bfloat16")({"observation.state": torch.zeros(2), "action_is_pad": torch.zeros(2).bool(),
                                          "sample_seed": torch.zeros(2)})
    assert [cast[key].dtype for key in cast] == [torch.bfloat16, torch.bool, torch.float32]
    on_meta = DeviceStep("meta")({"observation.state": torch.zeros(2), "sample_seed": torch.zeros(2)})
    assert (on_meta["observation.state"].device.type, on_meta["sample_seed"].device.type) == ("meta", "cpu")
    assert DeviceStep("cpu").get_config() == {"device": "cpu", "float_dtype": None}
    with pytest.raises(ConfigError, match=r"device_processor.float_dtype='int8': .* Fix: one of"):
        DeviceStep("cpu", "int8")
    renamed = RenameObservationsStep({"observation.images.cam": "observation.images.top"})(
        {"observation.images.cam": 1, "action": 2})
    assert renamed == {"observation.images.top": 1, "action": 2}


def test_imagenet_statistics_replace_the_cameras_mean_and_std() -> None:
    info = json.loads((PUSHT_META / "info.json").read_text())
    stats = json.loads((PUSHT_META / "stats.json").read_text())
    assert camera_keys(info["features"]) == ["observation.image"]
    replaced = with_imagenet_stats(stats, camera_keys(info["features"]))
    for name, value in IMAGENET_STATS.items():
        assert torch.equal(replaced["observation.image"][name], torch.tensor(value))
    assert replaced["observation.image"]["min"] == stats["observation.image"]["min"]
    assert replaced["observation.state"] == stats["observation.state"]
    assert stats["observation.image"]["mean"] != IMAGENET_STATS["mean"]  # the caller's dict is not changed


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"holds no policy_preprocessor\.json\. Fix: pass a pretrained_model directory"):
        PolicyProcessorPipeline.from_pretrained(tmp_path, "policy_preprocessor")
    manifest = tmp_path / "policy_preprocessor.json"
    manifest.write_text(json.dumps({"name": "policy_preprocessor",
                                    "steps": [{"registry_name": "action_tokenizer_processor", "config": {}}]}))
    with pytest.raises(ConfigError, match=r"uses the processor step 'action_tokenizer_processor', which lerobot_mg does "
                       r"not have \(it has \['absolute_actions_processor', 'device_processor', .*\]\)\. Fix: "):
        PolicyProcessorPipeline.from_pretrained(tmp_path, "policy_preprocessor")
    # A tokenizer step LeRobot saved without the tokenizer's name (it was handed a tokenizer object).
    manifest.write_text(json.dumps({"name": "policy_preprocessor",
                                    "steps": [{"registry_name": "tokenizer_processor", "config": {}}]}))
    with pytest.raises(ConfigError, match=r"^tokenizer_processor.config.tokenizer_name=None: is not saved, so the "
                       r"tokenizer the policy was trained with is unknown\. Fix: add "):
        PolicyProcessorPipeline.from_pretrained(tmp_path, "policy_preprocessor")
    # The files of lerobot_mg before it wrote LeRobot's: refused, saying what to do.
    manifest.write_text(json.dumps({"name": "policy_preprocessor", "steps": [
        {"name": "normalizer", "class": "NormalizerStep", "config": {}, "state_file": None}]}))
    with pytest.raises(ConfigError, match=r"written by a lerobot_mg older than its LeRobot 0.6.1 checkpoint format.*"
                       r"Fix: train the checkpoint again with this lerobot_mg"):
        PolicyProcessorPipeline.from_pretrained(tmp_path, "policy_preprocessor")
    PolicyProcessorPipeline("policy_preprocessor", [ToBatchStep()]).save_pretrained(tmp_path)
    PolicyProcessorPipeline("policy_postprocessor", [ToBatchStep()]).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"policy_preprocessor.json: policy_preprocessor has 0 normalizer_processor "
                       r"steps, not one\. Fix: "):
        load_processors(tmp_path)


def test_missing_or_mismatched_stats_are_user_errors() -> None:
    stats_without_std = {**STATS, "action": {"mean": [10.0, 20.0]}}
    with pytest.raises(
        ValueError, match=r"policy\.normalization_mapping\.ACTION='MEAN_STD': needs the 'std' statistic of 'action'.*"
        r"Fix: policy\.normalization_mapping\.ACTION=IDENTITY"
    ):
        make_processors(config_with(), INPUTS, OUTPUTS, stats_without_std)
    wrong_shape = {**STATS, "observation.state": {"mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}}
    with pytest.raises(ConfigError, match=r"stats\['observation.state'\]\['mean'\]\.shape=\(3,\): does not broadcast to the "
                       r"feature shape \(2,\)"):
        make_processors(config_with(), INPUTS, OUTPUTS, wrong_shape)
    # IDENTITY needs no statistics at all.
    make_processors(config_with(ACTION="IDENTITY"), INPUTS, OUTPUTS, stats_without_std)


def test_real_lerobot_stats_json() -> None:
    info = json.loads((PUSHT_META / "info.json").read_text())
    stats = json.loads((PUSHT_META / "stats.json").read_text())
    inputs, outputs = features_from_dataset(info["features"], None)
    pre, post = make_processors(ACTConfig(), inputs, outputs, stats)
    image = torch.rand(2, 3, 96, 96)
    action = torch.tensor(stats["action"]["mean"]).expand(2, 5, 2)
    out = pre({"observation.image": image, "action": action})
    expected = (image - torch.tensor(stats["observation.image"]["mean"])) / torch.tensor(
        stats["observation.image"]["std"]
    )
    torch.testing.assert_close(out["observation.image"], expected)
    torch.testing.assert_close(out["action"], torch.zeros(2, 5, 2), atol=1e-6, rtol=0)
    torch.testing.assert_close(post(out)["action"], action)
