"""Diffusion Policy: shapes, per-sample noise, the samplers, observation history, save/load, sizes, config.
(LeRobot 0.6.1's numbers on its own checkpoint: tests/unit/test_lerobot_diffusion.py.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lerobot_mg.config.act import ACTConfig
from lerobot_mg.config.loading import to_train_config
from lerobot_mg.data.sampler import sample_seeds
from lerobot_mg.errors import ConfigError
from lerobot_mg.peft.base import apply_policy_path
from lerobot_mg.policies import delta_timestamps, load_pretrained, make_policy
from lerobot_mg.policies.base import SAMPLE_SEED_KEY
from lerobot_mg.policies.diffusion import DiffusionConfig, DiffusionPolicy
from tests.launch_utils import PUSHT_SLICE
from tests.tolerances import FLOAT32_ULPS, assert_close
from tests.unit.test_config import _compose

STATE_DIM, ACTION_DIM, HORIZON, N_OBS, BATCH = 3, 2, 8, 2, 4
STATE_ONLY_INPUTS = {
    "observation.state": {"type": "STATE", "shape": [STATE_DIM]},
    "observation.environment_state": {"type": "ENV", "shape": [2]},
}
IMAGE_INPUTS = {
    "observation.state": {"type": "STATE", "shape": [STATE_DIM]},
    "observation.images.top": {"type": "VISUAL", "shape": [3, 20, 24]},
}
OUTPUTS = {"action": {"type": "ACTION", "shape": [ACTION_DIM]}}


def tiny_config(**overrides: object) -> DiffusionConfig:
    config = DiffusionConfig(
        n_obs_steps=N_OBS,
        horizon=HORIZON,
        n_action_steps=4,
        vision_backbone="lerobot_mg_cnn",
        vision_channels=[8, 16],
        spatial_softmax_num_keypoints=4,
        crop_shape=[16, 16],
        down_dims=[16, 32],
        diffusion_step_embed_dim=16,
        num_train_timesteps=20,
    )
    return replace(config, **overrides)


def make_batch(input_features: dict, seed: int = 0, seeds: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch = {key: torch.randn(BATCH, N_OBS, *spec["shape"], generator=generator) for key, spec in input_features.items()}
    batch["action"] = torch.randn(BATCH, HORIZON, ACTION_DIM, generator=generator).clamp(-1, 1)
    batch["action_is_pad"] = torch.zeros(BATCH, HORIZON, dtype=torch.bool)
    if seeds:
        batch[SAMPLE_SEED_KEY] = sample_seeds(7, 0, torch.arange(BATCH))
    return batch


def _slice(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {key: value[rows] for key, value in batch.items()}


@pytest.mark.parametrize("input_features", [STATE_ONLY_INPUTS, IMAGE_INPUTS], ids=["state_only", "image"])
def test_forward_backward_reaches_every_parameter(input_features: dict) -> None:
    torch.manual_seed(0)
    policy = DiffusionPolicy(tiny_config(), input_features, OUTPUTS).train()
    loss, logs = policy(make_batch(input_features))
    assert loss.ndim == 0 and torch.isfinite(loss) and logs == {}
    loss.backward()
    # DDP without find_unused_parameters needs every parameter to take part in the training loss.
    assert [name for name, param in policy.named_parameters() if param.grad is None] == []
    policy.eval()
    chunk = policy.predict_action_chunk(make_batch(input_features))
    assert chunk.shape == (BATCH, HORIZON, ACTION_DIM)


@pytest.mark.parametrize("input_features", [STATE_ONLY_INPUTS, IMAGE_INPUTS], ids=["state_only", "image"])
def test_noise_follows_the_sample_so_any_split_of_the_batch_gives_the_same_gradient(input_features: dict) -> None:
    """What makes DDP, FSDP and accumulation match one process: each sample draws its timestep, noise and crop
    from its own seed, so two half batches average to the whole batch's loss and gradient."""
    torch.manual_seed(0)
    policy = DiffusionPolicy(tiny_config(), input_features, OUTPUTS).train()
    batch = make_batch(input_features)
    whole, _ = policy(batch)
    whole.backward()
    whole_grads = [param.grad.clone() for param in policy.parameters()]
    policy.zero_grad()
    halves = [policy(_slice(batch, rows))[0] for rows in (slice(0, 2), slice(2, 4))]
    (sum(halves) / 2).backward()
    torch.testing.assert_close(sum(halves).item() / 2, whole.item(), rtol=1e-6, atol=0)
    for param, expected in zip(policy.parameters(), whole_grads):
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-6)
    # Other seeds: other noise (a loss that ignored the seeds would not move).
    reseeded = dict(batch, **{SAMPLE_SEED_KEY: sample_seeds(7, 1, torch.arange(BATCH))})
    assert abs(policy(reseeded)[0].item() - whole.item()) > 1e-4
    # The negative control: noise from the global RNG (as ranks seeded seed + rank would draw it) does not split.
    unseeded = {key: value for key, value in batch.items() if key != SAMPLE_SEED_KEY}
    torch.manual_seed(0)
    whole_unseeded = policy(unseeded)[0].item()
    torch.manual_seed(0)
    first_half = policy(_slice(unseeded, slice(0, 2)))[0].item()
    torch.manual_seed(1)
    second_half = policy(_slice(unseeded, slice(2, 4)))[0].item()
    assert abs((first_half + second_half) / 2 - whole_unseeded) > 1e-3


def test_without_seeds_the_global_rng_draws_the_noise() -> None:
    torch.manual_seed(0)
    policy = DiffusionPolicy(tiny_config(), STATE_ONLY_INPUTS, OUTPUTS).train()
    batch = make_batch(STATE_ONLY_INPUTS, seeds=False)
    torch.manual_seed(1)
    first = policy(batch)[0].item()
    torch.manual_seed(1)
    assert policy(batch)[0].item() == first
    assert policy(batch)[0].item() != first


def test_sample_seeds_depend_on_seed_epoch_and_index_only() -> None:
    seeds = sample_seeds(3, 0, torch.tensor([5, 6, 7]))
    assert seeds.dtype == torch.int64 and (seeds >= 0).all() and len(set(seeds.tolist())) == 3
    assert torch.equal(sample_seeds(3, 0, torch.tensor([7, 5])), seeds[[2, 0]])  # order and batch do not matter
    assert not set(sample_seeds(3, 1, torch.tensor([5, 6, 7])).tolist()) & set(seeds.tolist())
    assert not set(sample_seeds(4, 0, torch.tensor([5, 6, 7])).tolist()) & set(seeds.tolist())


def test_masked_loss_is_the_mean_over_the_frames_inside_the_episode() -> None:
    """LeRobot's do_mask_loss_for_padding: the squared errors of padded action frames are left out of the mean (its
    denominator too); unmasked, every entry counts."""
    torch.manual_seed(0)
    masked = DiffusionPolicy(tiny_config(do_mask_loss_for_padding=True), STATE_ONLY_INPUTS, OUTPUTS)
    unmasked = DiffusionPolicy(tiny_config(), STATE_ONLY_INPUTS, OUTPUTS)
    unmasked.load_state_dict(masked.state_dict())
    batch = make_batch(STATE_ONLY_INPUTS)
    all_valid = masked(batch)[0].item()
    assert all_valid == unmasked(batch)[0].item()
    batch["action_is_pad"][:, -3:] = True
    batch["action_is_pad"][0, -5:] = True
    timesteps, eps, _ = masked._training_draws(batch, BATCH)
    model = masked.diffusion
    noisy = model.noise_scheduler.add_noise(batch["action"], eps, timesteps)
    errors = (model.unet(noisy, timesteps, model.global_conditioning(batch)) - eps) ** 2
    expected = errors[~batch["action_is_pad"]].mean()
    torch.testing.assert_close(masked(batch)[0], expected, rtol=1e-6, atol=0)
    assert unmasked(batch)[0].item() == all_valid  # the mask only acts when asked for
    batch["action_is_pad"][:] = True
    assert masked(batch)[0].item() == 0.0


@pytest.mark.parametrize("scheduler", ["DDPM", "DDIM"])
@pytest.mark.parametrize("prediction_type", ["epsilon", "sample"])
def test_samplers_recover_the_clean_chunk_from_an_oracle(
    scheduler: str, prediction_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a U-Net that predicts the true noise (or the true chunk), diffusers' reverse steps land back on the
    clean chunk: DDIM exactly at each step, DDPM at its last (noise-free) step. The sampler walks diffusers'
    "leading" timesteps."""
    config = tiny_config(noise_scheduler_type=scheduler, prediction_type=prediction_type, num_inference_steps=5)
    policy = DiffusionPolicy(config, STATE_ONLY_INPUTS, OUTPUTS).eval()
    model = policy.diffusion
    assert type(model.noise_scheduler).__name__ == f"{scheduler}Scheduler"
    clean = torch.rand(BATCH, HORIZON, ACTION_DIM) * 2 - 1
    seen: list[int] = []

    def oracle(sample: torch.Tensor, timesteps: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        seen.append(int(timesteps[0]))
        alpha_bar = model.noise_scheduler.alphas_cumprod[timesteps][:, None, None]
        noise = (sample - alpha_bar.sqrt() * clean) / (1 - alpha_bar).sqrt()
        return noise if prediction_type == "epsilon" else clean

    monkeypatch.setattr(model.unet, "forward", oracle)
    torch.manual_seed(0)
    chunk = policy.predict_action_chunk(make_batch(STATE_ONLY_INPUTS))
    assert seen == [16, 12, 8, 4, 0]
    torch.testing.assert_close(chunk, clean, rtol=0, atol=1e-5)
    start = N_OBS - 1
    # Two samplings that draw other DDPM noise (the RNG moved on): the oracle lands both on the clean chunk, up to the
    # float32 rounding that noise went through (bit-identical only by luck of the draws: not the same computation)
    assert_close(policy.generate_actions(make_batch(STATE_ONLY_INPUTS), noise=torch.zeros_like(clean)),
                 policy.predict_action_chunk(make_batch(STATE_ONLY_INPUTS), noise=torch.zeros_like(clean))
                 [:, start : start + config.n_action_steps], **FLOAT32_ULPS)


def test_select_action_keeps_the_observation_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """The history a chunk is predicted from is what the dataset gives in training (the first frame repeated at
    an episode's start), and the actions run from the current frame on, n_action_steps of them."""
    policy = DiffusionPolicy(tiny_config(), {"observation.state": STATE_ONLY_INPUTS["observation.state"]}, OUTPUTS)
    policy.eval()
    seen: list[torch.Tensor] = []
    chunk = torch.arange(HORIZON, dtype=torch.float32)[None, :, None].expand(1, HORIZON, ACTION_DIM)

    def fake_predict(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append(batch["observation.state"].clone())
        return chunk + 100 * len(seen)

    monkeypatch.setattr(policy, "predict_action_chunk", fake_predict)
    observations = [torch.full((1, STATE_DIM), float(step)) for step in range(6)]
    actions = [policy.select_action({"observation.state": obs})[0, 0].item() for obs in observations]
    # Frame n_obs_steps - 1 = 1 of the chunk is the current one; 4 actions per chunk.
    assert actions == [101, 102, 103, 104, 201, 202]
    assert seen[0].shape == (1, N_OBS, STATE_DIM)
    assert seen[0][0, :, 0].tolist() == [0.0, 0.0] and seen[1][0, :, 0].tolist() == [3.0, 4.0]
    policy.reset()
    policy.select_action({"observation.state": observations[5]})
    assert seen[2][0, :, 0].tolist() == [5.0, 5.0]


def test_select_action_runs_the_real_sampler() -> None:
    torch.manual_seed(0)
    policy = DiffusionPolicy(tiny_config(noise_scheduler_type="DDIM", num_inference_steps=4), IMAGE_INPUTS, OUTPUTS)
    policy.eval()
    observation = {key: value[:, -1] for key, value in make_batch(IMAGE_INPUTS).items() if key in IMAGE_INPUTS}
    action = policy.select_action(observation)
    assert action.shape == (BATCH, ACTION_DIM) and torch.isfinite(action).all()
    assert action.abs().max() <= 1.0  # clip_sample keeps the clean chunk in [-1, 1]


@pytest.mark.parametrize("input_features", [STATE_ONLY_INPUTS, IMAGE_INPUTS], ids=["state_only", "image"])
def test_save_pretrained_round_trip(tmp_path: Path, input_features: dict) -> None:
    torch.manual_seed(0)
    policy = DiffusionPolicy(tiny_config(), input_features, OUTPUTS)
    policy.save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["type"] == "diffusion" and config["down_dims"] == [16, 32] and config["crop_shape"] == [16, 16]
    assert config["input_features"] == input_features and config["output_features"] == OUTPUTS
    assert "vision_channels" not in config  # lerobot_mg's own field: it lives in train_config.json
    # As a run's pretrained_model/ holds it: the run's own policy section (config.json may name LeRobot's backbone
    # for a policy that builds none).
    (tmp_path / "train_config.json").write_text(json.dumps({"policy": {
        "vision_channels": [8, 16], "vision_backbone": str(policy.config.vision_backbone)}}))

    loaded = load_pretrained(tmp_path)
    assert isinstance(loaded, DiffusionPolicy) and not loaded.training and loaded.config == policy.config
    policy.eval()
    batch = make_batch(input_features)
    torch.manual_seed(5)
    expected = policy.predict_action_chunk(batch)
    torch.manual_seed(5)
    assert torch.equal(loaded.predict_action_chunk(batch), expected)


def test_image_crop_is_random_in_training_and_central_at_inference() -> None:
    torch.manual_seed(0)
    policy = DiffusionPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS).train()
    batch = make_batch(IMAGE_INPUTS)
    _, _, corners = policy._training_draws(batch, BATCH)
    assert corners is not None and len(set(corners["observation.images.top"])) > 1
    assert all(0 <= top <= 4 and 0 <= left <= 8 for top, left in corners["observation.images.top"])
    frames = batch["observation.images.top"].flatten(0, 1)
    central = policy.diffusion.rgb_encoder[0].preprocess(frames)
    torch.testing.assert_close(central, frames[..., 2:18, 4:20])
    assert policy._training_draws(batch, BATCH)[2] == corners  # the sample seeds fix them
    assert policy.eval()._training_draws(batch, BATCH)[2] is None  # evaluation's loss: the centre crop
    not_random = DiffusionPolicy(tiny_config(crop_is_random=False), IMAGE_INPUTS, OUTPUTS).train()
    assert not_random._training_draws(batch, BATCH)[2] is None
    # torchvision's CenterCrop rounds half offsets to even: 7 spare rows start the crop at row 4.
    assert torch.equal(DiffusionPolicy(tiny_config(crop_shape=[13, 16]), IMAGE_INPUTS, OUTPUTS)
                       .diffusion.rgb_encoder[0].preprocess(frames), frames[..., 4:17, 4:20])


def test_resize_then_crop_ratio_as_lerobot_derives_it() -> None:
    config = tiny_config(resize_shape=[10, 12], crop_ratio=0.5, crop_shape=[84, 84])
    assert config.image_crop_shape == [5, 6]  # crop_shape gives way to crop_ratio of the resized image
    assert tiny_config(resize_shape=[10, 12]).image_crop_shape is None  # crop_ratio 1.0: no crop
    encoder = DiffusionPolicy(config, IMAGE_INPUTS, OUTPUTS).diffusion.rgb_encoder[0]
    frames = make_batch(IMAGE_INPUTS)["observation.images.top"].flatten(0, 1)
    resized = torch.nn.functional.interpolate(frames, size=(10, 12), mode="bilinear", antialias=True)
    torch.testing.assert_close(encoder.preprocess(frames), resized[..., 2:7, 3:9])


def test_shared_encoder_takes_every_camera_in_one_batch_norm_batch() -> None:
    """use_separate_rgb_encoder_per_camera=false: one encoder (rgb_encoder.*, not rgb_encoder.0.*) over all frames
    of all cameras; per step the features are [state, camera 1, camera 2]."""
    two_cameras = {**IMAGE_INPUTS, "observation.images.side": IMAGE_INPUTS["observation.images.top"]}
    torch.manual_seed(0)
    config = tiny_config(use_separate_rgb_encoder_per_camera=False, vision_backbone="resnet18")
    policy = DiffusionPolicy(config, two_cameras, OUTPUTS).eval()
    assert "diffusion.rgb_encoder.backbone.1.running_mean" in policy.state_dict()
    batch = make_batch(two_cameras)
    cond = policy.diffusion.global_conditioning(batch).reshape(BATCH, N_OBS, -1)
    assert cond.shape[-1] == STATE_DIM + 2 * 2 * config.spatial_softmax_num_keypoints
    torch.testing.assert_close(cond[..., :STATE_DIM], batch["observation.state"])
    side = policy.diffusion.rgb_encoder(batch["observation.images.side"].flatten(0, 1)).reshape(BATCH, N_OBS, -1)
    torch.testing.assert_close(cond[..., -side.shape[-1]:], side)


def test_default_sizes_are_lerobots() -> None:
    """LeRobot's defaults (down_dims 512-1024-2048, kernel 5, step embedding 128, FiLM scale, a ResNet18 per
    camera): for PushT (2-dim state and action, one 96x96 camera) the U-Net has 251.5M parameters and the camera
    encoder 11.2M."""
    with torch.device("meta"):
        policy = DiffusionPolicy(
            DiffusionConfig(),
            {"observation.state": {"type": "STATE", "shape": [2]},
             "observation.image": {"type": "VISUAL", "shape": [3, 96, 96]}},
            {"action": {"type": "ACTION", "shape": [2]}},
        )
    assert sum(p.numel() for p in policy.diffusion.unet.parameters()) == 251_511_938
    assert sum(p.numel() for p in policy.diffusion.rgb_encoder.parameters()) == 11_197_088
    assert sum(p.numel() for p in policy.parameters()) == 262_709_026


def test_pretrained_backbone_weights_load_from_a_local_file_unless_built_from_a_checkpoint(tmp_path: Path) -> None:
    """policy.pretrained_backbone_weights=<file of torchvision's ResNet18 weights> initialises every camera's trunk
    (torchvision's names, fc dropped); load_backbone_weights=False (a policy about to take a checkpoint's
    weights) leaves the file unread."""
    from safetensors.torch import save_file

    from lerobot_mg.policies.vision import ResNet18FeatureMap, ResNetNorm

    torch.manual_seed(3)
    torchvision_names = {key: value.clone() for key, value in ResNet18FeatureMap(ResNetNorm.BATCH_NORM).state_dict().items()}
    torchvision_names["fc.weight"] = torch.zeros(1000, 512)
    weights = tmp_path / "resnet18.safetensors"
    save_file(torchvision_names, str(weights))
    config = tiny_config(vision_backbone="resnet18", pretrained_backbone_weights=str(weights))
    config.validate()
    trunk = DiffusionPolicy(config, IMAGE_INPUTS, OUTPUTS).diffusion.rgb_encoder[0].backbone
    assert torch.equal(trunk[0].weight, torchvision_names["conv1.weight"])
    assert torch.equal(trunk[7][1].bn2.running_var, torchvision_names["layer4.1.bn2.running_var"])
    unread = DiffusionPolicy(replace(config, pretrained_backbone_weights=str(tmp_path / "absent.pth")), IMAGE_INPUTS,
                             OUTPUTS, load_backbone_weights=False)
    assert not torch.equal(unread.diffusion.rgb_encoder[0].backbone[0].weight, torchvision_names["conv1.weight"])
    with pytest.raises(ConfigError, match=r"policy.use_group_norm=True: would replace the batch norm layers.*Fix: "):
        replace(config, use_group_norm=True).validate()
    group_norm = DiffusionPolicy(tiny_config(vision_backbone="resnet18", use_group_norm=True), IMAGE_INPUTS, OUTPUTS)
    assert type(group_norm.diffusion.rgb_encoder[0].backbone[1]).__name__ == "GroupNorm"


def test_delta_timestamps_serve_the_history_and_the_chunk() -> None:
    info = json.loads((PUSHT_SLICE / "meta" / "info.json").read_text())
    fps = info["fps"]
    offsets = delta_timestamps(tiny_config(observation_keys=["observation.state"]), info["features"], fps)
    assert offsets == {
        "action": [step / fps for step in range(-1, HORIZON - 1)],
        "observation.state": [-1 / fps, 0.0],
    }
    # ACT: the current frame alone (no time dim) and a chunk from now on.
    assert delta_timestamps(ACTConfig(chunk_size=3), info["features"], fps) == {"action": [0.0, 1 / fps, 2 / fps]}


def test_make_policy_from_the_pusht_features() -> None:
    info = json.loads((PUSHT_SLICE / "meta" / "info.json").read_text())
    policy = make_policy(tiny_config(crop_shape=[84, 84]), info["features"])
    assert isinstance(policy, DiffusionPolicy)
    assert policy.input_features["observation.image"] == {"type": "VISUAL", "shape": [3, 96, 96]}
    with pytest.raises(ConfigError, match=r"policy.crop_shape=\[100, 84\]: is larger than the images.*\. Fix: policy.crop_shape=\[96,96\]"):
        make_policy(tiny_config(crop_shape=[100, 84]), info["features"])


def test_policy_path_to_a_diffusion_base_makes_a_diffusion_run(tmp_path: Path) -> None:
    """The base decides the policy type, whatever the preset; naming its preset lets the command line override
    the base's own keys."""
    base = tmp_path / "pretrained_model"
    torch.manual_seed(0)
    pusht_state = {"observation.state": {"type": "STATE", "shape": [2]}}
    DiffusionPolicy(tiny_config(observation_keys=["observation.state"]), pusht_state, OUTPUTS).save_pretrained(base)
    for extra, inference_steps in (([], None), (["policy=diffusion", "policy.num_inference_steps=5"], 5)):
        overrides = [f"dataset.root={PUSHT_SLICE}", f"policy.path={base}", *extra]
        policy = to_train_config(apply_policy_path(_compose(overrides), overrides)).policy
        assert isinstance(policy, DiffusionConfig) and policy.path == str(base)
        assert (policy.down_dims, policy.horizon, policy.num_inference_steps) == ([16, 32], HORIZON, inference_steps)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"horizon": 9}, r"policy.horizon=9: is not a multiple of 4 .*\. Fix: policy.horizon=12$"),
        ({"n_action_steps": 8}, r"policy.n_action_steps=8: exceeds the 7 frames.*\. Fix: policy.n_action_steps=7"),
        ({"n_groups": 5}, r"policy.n_groups=5: does not divide the U-Net widths \[16, 32\].*\. Fix: policy.n_groups=4$"),
        ({"kernel_size": 4}, r"policy.kernel_size=4: must be odd.*\. Fix: policy.kernel_size=5$"),
        ({"noise_scheduler_type": "DPM"}, r"policy.noise_scheduler_type='DPM': must be one of DDPM, DDIM\. Fix: policy.noise_scheduler_type=DDPM$"),
        ({"num_inference_steps": 30}, r"policy.num_inference_steps=30: exceeds policy.num_train_timesteps=20"),
        ({"crop_shape": [84]}, r"policy.crop_shape=\[84\]: must be \[height, width\]"),
        ({"crop_ratio": 0.0}, r"policy.crop_ratio=0.0: must be in \(0, 1\]"),
        ({"vision_backbone": "resnet50"}, r"policy.vision_backbone='resnet50': must be one of resnet18, lerobot_mg_cnn"),
        ({"pretrained_backbone_weights": "w.pth"}, r"policy.pretrained_backbone_weights='w.pth': are ResNet18 weights"),
        ({"down_dims": []}, r"policy.down_dims=\[\]: needs at least one positive width"),
        ({"n_obs_steps": 0}, r"policy.n_obs_steps=0: must be >= 1\. Fix: policy.n_obs_steps=1$"),
        ({"normalization_mapping": {"ACTION": "MINMAX"}}, r"policy.normalization_mapping.ACTION='MINMAX': must be one of .*\. Fix: policy.normalization_mapping.ACTION=MEAN_STD$"),
    ],
)
def test_config_validation_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides).validate()
    DiffusionConfig().validate()


def test_gradient_checkpointing_keeps_the_gradients_and_compile_model_keeps_the_keys() -> None:
    """LeRobot's gradient_checkpointing (the U-Net's residual blocks recomputed in backward) and compile_model
    (the U-Net compiled in place, so the state_dict keeps LeRobot's names)."""
    torch.manual_seed(0)
    plain = DiffusionPolicy(tiny_config(), STATE_ONLY_INPUTS, OUTPUTS).train()
    recomputed = DiffusionPolicy(tiny_config(gradient_checkpointing=True), STATE_ONLY_INPUTS, OUTPUTS).train()
    recomputed.load_state_dict(plain.state_dict())
    batch = make_batch(STATE_ONLY_INPUTS)
    for policy in (plain, recomputed):
        policy(batch)[0].backward()
    for (name, expected), actual in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=1e-6, atol=1e-7, msg=name)
    compiled = DiffusionPolicy(tiny_config(compile_model=True), STATE_ONLY_INPUTS, OUTPUTS)
    assert compiled.diffusion.unet._compiled_call_impl is not None
    assert list(compiled.state_dict()) == list(plain.state_dict())
