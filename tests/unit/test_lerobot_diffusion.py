"""LeRobot 0.6.1's Diffusion Policy, number for number: the fixture ``tests/fixtures/lerobot_0_6_1/diffusion_image``
(written by LeRobot's own code, see its PROVENANCE.md) builds here from its config.json, takes the weights its
manifest's recipe rebuilds, and gives every reference tensor LeRobot computed on the stored batch: the ResNet18
feature map, the global conditioning, the noised trajectory, the U-Net output, the loss with the stored noise and
timesteps, the DDIM chunk from the stored initial noise, and the train-mode conditioning with batch statistics.

The weights recipe and the image normalisation are written here (no shared helper existed when this was written).
"""

from __future__ import annotations

import copy
import hashlib
import json
import zlib
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.policies.diffusion import DiffusionConfig, DiffusionPolicy
from lerobot_mg.policies.diffusion.modeling_diffusion import SpatialSoftmax
from tests.lerobot_fixtures import RECIPE_IS_BIT_EXACT
from tests.tolerances import FLOAT32_ULPS, assert_close

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_0_6_1" / "diffusion_image"
PRETRAINED = FIXTURE / "pretrained_model"
CAMERA = "observation.images.top"
# Fields of LeRobot's config.json that every policy type shares: the base config's (lerobot_mg.config.policy).
SHARED_FIELDS = {"type", "n_obs_steps", "input_features", "output_features", "device", "use_amp", "use_peft",
                 "push_to_hub", "repo_id", "private", "tags", "license", "pretrained_path", "pretrained_revision",
                 "normalization_mapping"}
# LeRobot 0.6.1's DiffusionConfig defaults (lerobot/policies/diffusion/configuration_diffusion.py), except
# pretrained_backbone_weights: "ResNet18_Weights.IMAGENET1K_V1" there, null here (no download unless asked for).
LEROBOT_DEFAULTS = {
    "n_obs_steps": 2, "horizon": 64, "n_action_steps": 32,
    "normalization_mapping": {"VISUAL": "MEAN_STD", "STATE": "MIN_MAX", "ACTION": "MIN_MAX"},
    "drop_n_last_frames": 7, "vision_backbone": "resnet18", "resize_shape": None, "crop_ratio": 1.0,
    "crop_shape": None, "crop_is_random": True, "pretrained_backbone_weights": None, "use_group_norm": False,
    "spatial_softmax_num_keypoints": 32, "use_separate_rgb_encoder_per_camera": True, "down_dims": [512, 1024, 2048],
    "kernel_size": 5, "n_groups": 8, "diffusion_step_embed_dim": 128, "use_film_scale_modulation": True,
    "gradient_checkpointing": False, "noise_scheduler_type": "DDPM", "num_train_timesteps": 100,
    "beta_schedule": "squaredcos_cap_v2", "beta_start": 0.0001, "beta_end": 0.02, "prediction_type": "epsilon",
    "clip_sample": True, "clip_sample_range": 1.0, "num_inference_steps": None, "compile_model": False,
    "compile_mode": "reduce-overhead", "do_mask_loss_for_padding": False, "optimizer_lr": 1e-4,
    "optimizer_betas": [0.95, 0.999], "optimizer_eps": 1e-8, "optimizer_weight_decay": 1e-6,
    "scheduler_name": "cosine", "scheduler_warmup_steps": 500,
}


def _config_json() -> dict:
    return json.loads((PRETRAINED / "config.json").read_text())


def fixture_policy() -> DiffusionPolicy:
    """The fixture's config.json as a DiffusionConfig (the shared fields this config class lacks left out), on the
    fixture's features; the backbone weights file is never read (there is none: null)."""
    raw = _config_json()
    known = {field.name for field in fields(DiffusionConfig)}
    config = DiffusionConfig(**{key: value for key, value in raw.items()
                                if key in known and key not in ("input_features", "output_features")})
    config.validate()
    return DiffusionPolicy(config, raw["input_features"], raw["output_features"])


def recipe_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PROVENANCE.md "Weights": every key from its own generator seeded by crc32(key), by rule; the
    constructor-computed buffer from constant_buffers.safetensors."""
    constants = load_file(str(FIXTURE / "constant_buffers.safetensors"))
    weights = {}
    for key, tensor in state_dict.items():
        if key in constants:
            weights[key] = constants[key]
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        if key.endswith("running_var"):
            weights[key] = torch.rand(tensor.shape, generator=generator) + 0.5
        elif key.endswith("num_batches_tracked"):
            weights[key] = torch.zeros(tensor.shape, dtype=torch.int64)
        elif key.endswith(".weight") and tensor.dim() == 1:
            weights[key] = 1 + 0.1 * torch.randn(tensor.shape, generator=generator)
        else:
            weights[key] = 0.02 * torch.randn(tensor.shape, generator=generator)
    return weights


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference.safetensors"))


@pytest.fixture(scope="module")
def stats() -> dict[str, torch.Tensor]:
    return load_file(str(PRETRAINED / "policy_preprocessor_step_3_normalizer_processor.safetensors"))


@pytest.fixture(scope="module")
def policy(one_thread: None) -> DiffusionPolicy:
    policy = fixture_policy()
    policy.load_state_dict(recipe_weights(policy.state_dict()), strict=True)
    return policy.eval()


@pytest.fixture(scope="module")
def batch(reference: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stored batch as LeRobot's preprocessor hands it to the policy: the stored normalised state and action,
    the camera's uint8 frames / 255 normalised with the file's (ImageNet) mean and std, LeRobot's eps 1e-8."""
    images = reference[f"input.{CAMERA}.uint8"].to(torch.float32) / 255.0
    mean, std = stats[f"{CAMERA}.mean"], stats[f"{CAMERA}.std"]
    return {
        "observation.state": reference["pre.observation.state"],
        CAMERA: (images - mean) / (std + 1e-8),
        "action": reference["pre.action"],
        "action_is_pad": reference["input.action_is_pad"],
    }


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


# --- config and state_dict ---------------------------------------------------------------------------------


def test_config_has_lerobots_fields_types_and_defaults() -> None:
    ours = {field.name for field in fields(DiffusionConfig)} - DiffusionConfig.lerobot_mg_only_fields
    theirs = set(_config_json())
    assert ours <= theirs, ours - theirs
    # What LeRobot writes that this class lacks is the shared fields the base config will carry.
    assert theirs - ours <= SHARED_FIELDS, theirs - ours - SHARED_FIELDS
    defaults = DiffusionConfig()
    for name, value in LEROBOT_DEFAULTS.items():
        ours_value = getattr(defaults, name)
        assert ours_value == value and json.dumps(ours_value) == json.dumps(value), name
    # The fixture's own values survive the round trip (lists as JSON writes them).
    policy_config = fixture_policy().config
    for name, value in _config_json().items():
        if name in {field.name for field in fields(DiffusionConfig)}:
            assert json.loads(json.dumps(getattr(policy_config, name))) == value, name


def test_state_dict_is_lerobots_and_the_recipe_rebuilds_every_tensor() -> None:
    manifest = json.loads((FIXTURE / "state_dict_manifest.json").read_text())
    policy = fixture_policy()
    state_dict = policy.state_dict()
    assert list(state_dict) == [entry["key"] for entry in manifest["keys"]]
    buffers = {name for name, _ in policy.named_buffers()}
    for entry in manifest["keys"]:
        tensor = state_dict[entry["key"]]
        assert list(tensor.shape) == entry["shape"], entry["key"]
        assert str(tensor.dtype).removeprefix("torch.") == entry["dtype"], entry["key"]
        assert (entry["key"] in buffers) == (entry["kind"] == "buffer"), entry["key"]
    assert sum(p.numel() for p in policy.parameters()) == manifest["n_parameters"]
    weights = recipe_weights(state_dict)
    if RECIPE_IS_BIT_EXACT:  # torch.randn's bits are LeRobot's only with ATen's AVX2 kernels (tests/lerobot_fixtures.py)
        assert [e["key"] for e in manifest["keys"] if _sha256(weights[e["key"]]) != e["sha256"]] == []
    policy.load_state_dict(weights, strict=True)
    # The constructor computes LeRobot's pos_grid (numpy's linspace); stored from LeRobot's machine: up to ulps.
    constants = load_file(str(FIXTURE / "constant_buffers.safetensors"))
    assert_close(SpatialSoftmax((512, 3, 3), 32).pos_grid, constants["diffusion.rgb_encoder.0.pool.pos_grid"],
                 **FLOAT32_ULPS)


# --- the reference numbers -----------------------------------------------------------------------------------


def test_scheduler_is_lerobots(policy: DiffusionPolicy, reference: dict[str, torch.Tensor]) -> None:
    scheduler = policy.diffusion.noise_scheduler
    assert type(scheduler).__name__ == "DDIMScheduler"
    expected = json.loads((FIXTURE / "reference.json").read_text())["noise_scheduler"]
    assert {key: scheduler.config[key] for key in expected if key != "class"} == {
        key: value for key, value in expected.items() if key != "class"
    }
    # A float32 cumulative product of cosines, here and on LeRobot's CPU: their kernels' ulps
    assert_close(scheduler.alphas_cumprod.cpu(), reference["scheduler.alphas_cumprod"], **FLOAT32_ULPS)
    scheduler.set_timesteps(policy.config.inference_steps)
    assert torch.equal(scheduler.timesteps, reference["eval.ddim_timesteps"])


def test_backbone_and_global_conditioning(policy: DiffusionPolicy, batch: dict, reference: dict) -> None:
    encoder = policy.diffusion.rgb_encoder[0]
    with torch.no_grad():
        frames = batch[CAMERA].flatten(0, 1)
        _assert_close(encoder.backbone(encoder.preprocess(frames)), reference["eval.backbone_feature_map"], 1e-5)
        _assert_close(policy.diffusion.global_conditioning(batch), reference["eval.global_cond"], 1e-6)


def test_noising_unet_and_loss(policy: DiffusionPolicy, batch: dict, reference: dict,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    eps, timesteps = reference["input.loss_eps"], reference["input.loss_timesteps"]
    model = policy.diffusion
    with torch.no_grad():
        noisy = model.noise_scheduler.add_noise(batch["action"], eps, timesteps)
        _assert_close(noisy, reference["eval.noisy_trajectory"], 1e-6)
        _assert_close(model.unet(noisy, timesteps, reference["eval.global_cond"]), reference["eval.unet_out"], 1e-6)
        _assert_close(model.compute_loss(batch, eps, timesteps), reference["eval.loss"], 1e-6)
        # policy.forward with the stored draws standing in for the per-sample ones: the same loss.
        monkeypatch.setattr(policy, "_training_draws", lambda batch, batch_size: (timesteps, eps, None))
        loss, logs = policy(batch)
    _assert_close(loss, reference["eval.loss"], 1e-6)
    assert logs == {}


def test_ddim_action_chunk(policy: DiffusionPolicy, batch: dict, reference: dict, stats: dict) -> None:
    observation = {key: value for key, value in batch.items() if key.startswith("observation.")}
    chunk = policy.generate_actions(observation, noise=reference["input.sample_noise"].clone())
    _assert_close(chunk, reference["eval.action_chunk"], 1e-5)
    low, high = stats["action.min"], stats["action.max"]  # LeRobot's MIN_MAX inverse
    _assert_close((chunk + 1) / 2 * (high - low) + low, reference["eval.action_chunk_unnormalized"], 1e-5)


def test_train_mode_uses_batch_statistics_and_the_centre_crop_without_crop_is_random(
    policy: DiffusionPolicy, batch: dict, reference: dict,
) -> None:
    config = copy.deepcopy(policy.config)
    config.crop_is_random = False
    trained = DiffusionPolicy(config, policy.input_features, policy.output_features)
    trained.load_state_dict(policy.state_dict(), strict=True)
    trained.train()
    corners = trained._training_draws(batch, batch["action"].shape[0])[2]
    assert corners is None  # the centre crop, also in training
    with torch.no_grad():
        _assert_close(trained.diffusion.global_conditioning(batch, corners), reference["train_center_crop.global_cond"],
                      1e-5)
    bn1 = trained.diffusion.rgb_encoder[0].backbone[1]
    _assert_close(bn1.running_mean, reference["train_center_crop.bn1_running_mean_after"], 1e-6)
    _assert_close(bn1.running_var, reference["train_center_crop.bn1_running_var_after"], 1e-6)
