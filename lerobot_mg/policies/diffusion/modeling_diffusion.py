"""Diffusion Policy (Chi et al. 2023, "Diffusion Policy: Visuomotor Policy Learning via Action Diffusion"), plain
torch, following the structure of LeRobot's `modeling_diffusion.py`.

Training (DDPM objective): a chunk of `horizon` actions is noised to a random timestep and the 1-D temporal
convolutional U-Net predicts the noise (or the clean chunk), conditioned through FiLM on the diffusion timestep
and the observation features of the last `n_obs_steps` frames. Inference: start from Gaussian noise and denoise
with the DDPM or DDIM sampler over `num_inference_steps` steps.

Every random draw of a training sample (timestep, noise, image crop) comes from a generator seeded by the
sample's own seed (`SAMPLE_SEED_KEY`), so one process, DDP, FSDP and gradient accumulation train on the same
noise and match each other; a batch without seeds draws them from the global RNG.

The network has no repeated block, so it declares no FSDP wrap units: sharded runs choose them by size
(`accelerator.fsdp.min_num_params`) or by class (`accelerator.fsdp.wrap_modules`). It declares the blocks that
activation checkpointing recomputes.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lerobot_mg.config.diffusion import DiffusionConfig
from lerobot_mg.errors import config_error
from lerobot_mg.policies.base import SAMPLE_SEED_KEY, FeatureSpec, PreTrainedPolicy
from lerobot_mg.policies.vision import VisionBackbone

# --- noise schedule and samplers ---------------------------------------------------------------------------


def _betas(config: DiffusionConfig) -> Tensor:
    """(num_train_timesteps,) float64 betas, as diffusers' schedulers define them."""
    num_steps = config.num_train_timesteps
    if config.beta_schedule == "linear":
        return torch.linspace(config.beta_start, config.beta_end, num_steps, dtype=torch.float64)
    if config.beta_schedule == "scaled_linear":
        return torch.linspace(config.beta_start**0.5, config.beta_end**0.5, num_steps, dtype=torch.float64) ** 2
    # squaredcos_cap_v2 (Nichol & Dhariwal 2021): alpha_bar(t) = cos^2((t + 0.008) / 1.008 * pi / 2), beta <= 0.999.
    steps = torch.arange(num_steps + 1, dtype=torch.float64) / num_steps
    alpha_bar = torch.cos((steps + 0.008) / 1.008 * math.pi / 2) ** 2
    return torch.clamp(1 - alpha_bar[1:] / alpha_bar[:-1], max=0.999)


class NoiseSchedule:
    """The forward (noising) process and one reverse step of the DDPM (fixed-small variance) or DDIM (eta = 0)
    sampler, with diffusers' "leading" timestep spacing and final alpha of one."""

    def __init__(self, config: DiffusionConfig) -> None:
        self.config = config
        self.alphas_cumprod = torch.cumprod(1.0 - _betas(config), dim=0)

    def add_noise(self, clean_BTA: Tensor, noise_BTA: Tensor, timesteps_B: Tensor) -> Tensor:
        alpha_bar_B11 = self.alphas_cumprod.to(clean_BTA.device)[timesteps_B].to(clean_BTA.dtype)[:, None, None]
        return alpha_bar_B11.sqrt() * clean_BTA + (1 - alpha_bar_B11).sqrt() * noise_BTA

    def inference_timesteps(self) -> list[int]:
        stride = self.config.num_train_timesteps // self.config.inference_steps
        return [step * stride for step in reversed(range(self.config.inference_steps))]

    def step(self, model_output_BTA: Tensor, timestep: int, sample_BTA: Tensor) -> Tensor:
        """The sample at the previous inference timestep (float32 in, float32 out)."""
        config = self.config
        previous = timestep - config.num_train_timesteps // config.inference_steps
        alpha_bar = float(self.alphas_cumprod[timestep])
        alpha_bar_prev = float(self.alphas_cumprod[previous]) if previous >= 0 else 1.0
        if config.prediction_type == "epsilon":
            noise = model_output_BTA
            clean = (sample_BTA - (1 - alpha_bar) ** 0.5 * noise) / alpha_bar**0.5
        else:
            clean = model_output_BTA
            noise = (sample_BTA - alpha_bar**0.5 * clean) / (1 - alpha_bar) ** 0.5
        if config.clip_sample:
            clean = clean.clamp(-config.clip_sample_range, config.clip_sample_range)
        if config.noise_scheduler_type == "DDIM":
            if config.clip_sample:  # the noise that leads to the clipped clean sample
                noise = (sample_BTA - alpha_bar**0.5 * clean) / (1 - alpha_bar) ** 0.5
            return alpha_bar_prev**0.5 * clean + (1 - alpha_bar_prev) ** 0.5 * noise
        alpha = alpha_bar / alpha_bar_prev
        beta = 1 - alpha
        mean = (alpha_bar_prev**0.5 * beta * clean + alpha**0.5 * (1 - alpha_bar_prev) * sample_BTA) / (1 - alpha_bar)
        if timestep == 0:
            return mean
        variance = max((1 - alpha_bar_prev) / (1 - alpha_bar) * beta, 1e-20)
        return mean + variance**0.5 * torch.randn_like(mean)


# --- observation encoder ---------------------------------------------------------------------------------


class SpatialSoftmax(nn.Module):
    """Keypoints of a feature map (Finn et al. 2016): a 1x1 conv to K maps, a softmax over each map's pixels and
    the expected (x, y) position in [-1, 1] under it. (B, C, H, W) -> (B, K, 2)."""

    def __init__(self, in_channels: int, num_keypoints: int) -> None:
        super().__init__()
        self.keypoint_maps = nn.Conv2d(in_channels, num_keypoints, kernel_size=1)

    def forward(self, features_BCHW: Tensor) -> Tensor:
        maps_BKHW = self.keypoint_maps(features_BCHW)
        batch, num_keypoints, height, width = maps_BKHW.shape
        attention = torch.softmax(maps_BKHW.reshape(batch * num_keypoints, height * width).float(), dim=-1)
        ys, xs = torch.meshgrid(
            torch.linspace(-1.0, 1.0, height, device=maps_BKHW.device),
            torch.linspace(-1.0, 1.0, width, device=maps_BKHW.device),
            indexing="ij",
        )
        grid_P2 = torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)
        return (attention @ grid_P2).reshape(batch, num_keypoints, 2).to(features_BCHW.dtype)


class RgbEncoder(nn.Module):
    """Backbone -> spatial softmax -> linear + ReLU: (N, C, H, W) -> (N, 2 * num_keypoints)."""

    def __init__(self, in_channels: int, config: DiffusionConfig) -> None:
        super().__init__()
        self.backbone = VisionBackbone(in_channels, list(config.vision_channels))
        self.pool = SpatialSoftmax(self.backbone.num_out_channels, config.spatial_softmax_num_keypoints)
        self.feature_dim = 2 * config.spatial_softmax_num_keypoints
        self.out = nn.Linear(self.feature_dim, self.feature_dim)

    def forward(self, images_NCHW: Tensor) -> Tensor:
        return F.relu(self.out(self.pool(self.backbone(images_NCHW)).flatten(1)))


class ObservationEncoder(nn.Module):
    """(B, n_obs_steps, ...) inputs -> the U-Net's global conditioning (B, n_obs_steps * per-frame features):
    state and environment vectors as they are, each camera through an RgbEncoder (shared unless
    `use_separate_rgb_encoder_per_camera`)."""

    def __init__(self, config: DiffusionConfig, input_features: dict[str, FeatureSpec]) -> None:
        super().__init__()
        self.keys = list(input_features)
        self.image_keys = [key for key, spec in input_features.items() if spec["type"] == "VISUAL"]
        vector_dims = {key: int(spec["shape"][0]) for key, spec in input_features.items() if spec["type"] != "VISUAL"}
        for key, spec in input_features.items():
            if spec["type"] != "VISUAL" and len(spec["shape"]) != 1:
                raise config_error("policy.observation_keys", list(input_features),
                                   f"Diffusion takes 1-D state features, but {key!r} has shape {list(spec['shape'])}",
                                   f"leave {key!r} out of policy.observation_keys")
        self.rgb_encoders = nn.ModuleList()
        if self.image_keys:
            channels = {int(input_features[key]["shape"][0]) for key in self.image_keys}
            if len(channels) != 1 and not config.use_separate_rgb_encoder_per_camera:
                raise config_error(
                    "policy.use_separate_rgb_encoder_per_camera", config.use_separate_rgb_encoder_per_camera,
                    "one shared image encoder needs the same channel count in every camera; got "
                    f"{ {key: input_features[key]['shape'] for key in self.image_keys} }",
                    "policy.use_separate_rgb_encoder_per_camera=true",
                )
            num_encoders = len(self.image_keys) if config.use_separate_rgb_encoder_per_camera else 1
            self.rgb_encoders.extend(
                RgbEncoder(int(input_features[self.image_keys[index]]["shape"][0]), config)
                for index in range(num_encoders)
            )
        image_dim = len(self.image_keys) * (self.rgb_encoders[0].feature_dim if self.image_keys else 0)
        self.cond_dim = config.n_obs_steps * (sum(vector_dims.values()) + image_dim)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        features = []
        for key in self.keys:
            frames = batch[key]
            if key in self.image_keys:
                index = self.image_keys.index(key) if len(self.rgb_encoders) > 1 else 0
                batch_size, num_steps = frames.shape[:2]
                encoded = self.rgb_encoders[index](frames.flatten(0, 1))
                frames = encoded.reshape(batch_size, num_steps, -1)
            features.append(frames)
        return torch.cat(features, dim=-1).flatten(1)


# --- the conditional U-Net -------------------------------------------------------------------------------


def timestep_embedding(timesteps_B: Tensor, dim: int) -> Tensor:
    """(B,) diffusion timesteps -> (B, dim) [sin, cos] embedding (the transformer's 10000 base)."""
    half = dim // 2
    frequencies = torch.exp(
        torch.arange(half, device=timesteps_B.device, dtype=torch.float32) * -(math.log(10000.0) / (half - 1))
    )
    angles_BH = timesteps_B.float()[:, None] * frequencies[None, :]
    return torch.cat([angles_BH.sin(), angles_BH.cos()], dim=-1)


class Conv1dBlock(nn.Sequential):
    """Conv1d -> GroupNorm -> Mish, keeping the time length."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, n_groups: int) -> None:
        super().__init__(
            nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2),
            nn.GroupNorm(n_groups, out_channels),
            nn.Mish(),
        )


class ConditionalResidualBlock1d(nn.Module):
    """Two Conv1dBlocks with FiLM between them: the conditioning gives a per-channel scale and bias (or a bias
    only without `use_film_scale_modulation`)."""

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, config: DiffusionConfig) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.use_scale = config.use_film_scale_modulation
        self.conv1 = Conv1dBlock(in_channels, out_channels, config.kernel_size, config.n_groups)
        self.cond_encoder = nn.Sequential(
            nn.Mish(), nn.Linear(cond_dim, 2 * out_channels if self.use_scale else out_channels)
        )
        self.conv2 = Conv1dBlock(out_channels, out_channels, config.kernel_size, config.n_groups)
        self.residual_conv: nn.Module = (
            nn.Conv1d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()
        )

    def forward(self, x_BCT: Tensor, cond_BD: Tensor) -> Tensor:
        out = self.conv1(x_BCT)
        film = self.cond_encoder(cond_BD)[:, :, None]
        if self.use_scale:
            out = film[:, : self.out_channels] * out + film[:, self.out_channels :]
        else:
            out = out + film
        return self.conv2(out) + self.residual_conv(x_BCT)


class ConditionalUnet1d(nn.Module):
    """The denoiser: (noisy actions (B, T, A), timesteps (B,), global conditioning (B, G)) -> (B, T, A).

    Levels of `down_dims` widths: two residual blocks each, every level but the last halving T; two middle
    blocks; an up path that concatenates the skip of the matching level and doubles T; a final conv block.
    As in the original (and LeRobot), the first level's skip is not used by the up path.
    """

    def __init__(self, config: DiffusionConfig, action_dim: int, global_cond_dim: int) -> None:
        super().__init__()
        embed_dim = config.diffusion_step_embed_dim
        self.embed_dim = embed_dim
        self.diffusion_step_encoder = nn.Sequential(
            nn.Linear(embed_dim, 4 * embed_dim), nn.Mish(), nn.Linear(4 * embed_dim, embed_dim)
        )
        cond_dim = embed_dim + global_cond_dim
        widths = [action_dim, *config.down_dims]
        levels = list(zip(widths[:-1], widths[1:]))

        def block(in_channels: int, out_channels: int) -> ConditionalResidualBlock1d:
            return ConditionalResidualBlock1d(in_channels, out_channels, cond_dim, config)

        self.down_modules = nn.ModuleList()
        for index, (in_channels, out_channels) in enumerate(levels):
            is_last = index == len(levels) - 1
            resample: nn.Module = nn.Identity() if is_last else nn.Conv1d(out_channels, out_channels, 3, 2, 1)
            self.down_modules.append(
                nn.ModuleList([block(in_channels, out_channels), block(out_channels, out_channels), resample])
            )
        bottom = config.down_dims[-1]
        self.mid_modules = nn.ModuleList([block(bottom, bottom), block(bottom, bottom)])
        self.up_modules = nn.ModuleList()
        for out_channels, in_channels in reversed(levels[1:]):
            self.up_modules.append(
                nn.ModuleList(
                    [
                        block(2 * in_channels, out_channels),
                        block(out_channels, out_channels),
                        nn.ConvTranspose1d(out_channels, out_channels, 4, 2, 1),
                    ]
                )
            )
        first = config.down_dims[0]
        self.final_conv = nn.Sequential(
            Conv1dBlock(first, first, config.kernel_size, config.n_groups), nn.Conv1d(first, action_dim, 1)
        )

    def forward(self, noisy_BTA: Tensor, timesteps_B: Tensor, global_cond_BG: Tensor) -> Tensor:
        # Compute in the dtype of the incoming sample (FSDP's mixed precision casts inputs at unit boundaries).
        x_BCT = noisy_BTA.transpose(1, 2)
        step_embedding = timestep_embedding(timesteps_B, self.embed_dim).to(x_BCT.dtype)
        cond_BD = torch.cat([self.diffusion_step_encoder(step_embedding), global_cond_BG.to(x_BCT.dtype)], dim=-1)
        skips = []
        for first_block, second_block, downsample in self.down_modules:
            x_BCT = second_block(first_block(x_BCT, cond_BD), cond_BD)
            skips.append(x_BCT)
            x_BCT = downsample(x_BCT)
        for mid_block in self.mid_modules:
            x_BCT = mid_block(x_BCT, cond_BD)
        for first_block, second_block, upsample in self.up_modules:
            x_BCT = torch.cat([x_BCT, skips.pop()], dim=1)
            x_BCT = upsample(second_block(first_block(x_BCT, cond_BD), cond_BD))
        # A copy, not a view: FSDP2 warns that an in-place op on a unit's view output would skip its hooks.
        return self.final_conv(x_BCT).transpose(1, 2).contiguous()


# --- the policy ------------------------------------------------------------------------------------------


class DiffusionPolicy(PreTrainedPolicy):
    name: ClassVar[str] = "diffusion"
    config_class: ClassVar[type] = DiffusionConfig
    # Activation checkpointing recomputes each residual block (and each image-backbone block): size-based wrap
    # units would be single convolutions (nothing to save) or the whole U-Net (everything recomputed at once).
    _checkpoint_modules: ClassVar[list[str]] = ["ConditionalResidualBlock1d", "BasicBlock"]

    def __init__(
        self,
        config: DiffusionConfig,
        input_features: dict[str, FeatureSpec],
        output_features: dict[str, FeatureSpec],
    ) -> None:
        super().__init__(config, input_features, output_features)
        self.config: DiffusionConfig = config
        if "action" not in output_features or len(output_features["action"]["shape"]) != 1:
            raise config_error("output_features", output_features, "Diffusion needs a 1-D 'action' output feature",
                               "a dataset (dataset.root) whose 'action' feature is 1-D")
        self.action_dim = int(output_features["action"]["shape"][0])
        self.image_keys = [key for key, spec in self.input_features.items() if spec["type"] == "VISUAL"]
        encoder_features = {key: dict(spec) for key, spec in self.input_features.items()}
        if config.crop_shape is not None:
            for key in self.image_keys:
                _, height, width = self.input_features[key]["shape"]
                crop_height, crop_width = config.crop_shape
                if crop_height > height or crop_width > width:
                    raise config_error(
                        "policy.crop_shape", list(config.crop_shape), f"is larger than the images of {key!r} "
                        f"({height}x{width})", f"policy.crop_shape=[{height},{width}], or policy.crop_shape=null"
                    )
                encoder_features[key]["shape"] = [self.input_features[key]["shape"][0], crop_height, crop_width]
        self.obs_encoder = ObservationEncoder(config, encoder_features)  # type: ignore[arg-type]
        self.unet = ConditionalUnet1d(config, self.action_dim, self.obs_encoder.cond_dim)
        self.noise_schedule = NoiseSchedule(config)

    def _check_inputs(self, batch: dict[str, Tensor], need_action: bool) -> None:
        self._require_keys(batch, need_action)
        n_obs_steps = self.config.n_obs_steps
        for key in self.input_features:
            if batch[key].dim() < 3 or batch[key].shape[1] != n_obs_steps:
                raise ValueError(
                    f"{key!r} has shape {list(batch[key].shape)}; Diffusion needs (batch, n_obs_steps={n_obs_steps}, "
                    "...): load observations at policy.observation_delta_indices."
                )
        if need_action and batch["action"].shape[1] != self.config.horizon:
            raise ValueError(
                f"The batch's action chunk has {batch['action'].shape[1]} steps but policy.horizon="
                f"{self.config.horizon}; load actions at policy.action_delta_indices."
            )

    def _crop(self, batch: dict[str, Tensor], corners: dict[str, list[tuple[int, int]]] | None) -> dict[str, Tensor]:
        """Images cropped to `crop_shape`: at each sample's own corner in training, at the centre otherwise."""
        if self.config.crop_shape is None or not self.image_keys:
            return batch
        crop_height, crop_width = self.config.crop_shape
        cropped = dict(batch)
        for key in self.image_keys:
            images_BTCHW = batch[key]
            height, width = images_BTCHW.shape[-2:]
            if corners is None:
                top, left = (height - crop_height) // 2, (width - crop_width) // 2
                cropped[key] = images_BTCHW[..., top : top + crop_height, left : left + crop_width]
            else:
                cropped[key] = torch.stack(
                    [
                        sample[..., top : top + crop_height, left : left + crop_width]
                        for sample, (top, left) in zip(images_BTCHW, corners[key])
                    ]
                )
        return cropped

    def _training_draws(
        self, batch: dict[str, Tensor], batch_size: int
    ) -> tuple[Tensor, Tensor, dict[str, list[tuple[int, int]]] | None]:
        """(timesteps (B,), noise (B, horizon, A) float32, crop corners), each sample from its own seed."""
        seeds = batch.get(SAMPLE_SEED_KEY)
        if seeds is None:
            seeds = torch.randint(0, 2**62, (batch_size,))
        config = self.config
        random_crop = config.crop_is_random and config.crop_shape is not None and bool(self.image_keys)
        timesteps, noises = [], []
        corners: dict[str, list[tuple[int, int]]] = {key: [] for key in self.image_keys}
        for seed in seeds.tolist():
            generator = torch.Generator().manual_seed(seed)
            timesteps.append(int(torch.randint(config.num_train_timesteps, (1,), generator=generator)))
            noises.append(torch.randn(config.horizon, self.action_dim, generator=generator))
            if random_crop:
                for key in self.image_keys:
                    height, width = batch[key].shape[-2:]
                    top = int(torch.randint(height - config.crop_shape[0] + 1, (1,), generator=generator))
                    left = int(torch.randint(width - config.crop_shape[1] + 1, (1,), generator=generator))
                    corners[key].append((top, left))
        return torch.tensor(timesteps), torch.stack(noises), corners if random_crop else None

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """Mean squared error of the U-Net's noise (or clean-chunk) prediction at each sample's random
        timestep; with `do_mask_loss_for_padding`, padded frames count as zero error (every sample weighs the
        same, so data-parallel ranks average to the one-process loss)."""
        self._check_inputs(batch, need_action=True)
        actions_BTA = batch["action"]
        device = actions_BTA.device
        timesteps_B, noise_BTA, corners = self._training_draws(batch, actions_BTA.shape[0])
        timesteps_B, noise_BTA = timesteps_B.to(device), noise_BTA.to(device)
        cond_BG = self.obs_encoder(self._crop(batch, corners))
        noisy_BTA = self.noise_schedule.add_noise(actions_BTA.float(), noise_BTA, timesteps_B)
        prediction_BTA = self.unet(noisy_BTA.to(actions_BTA.dtype), timesteps_B, cond_BG)
        target_BTA = noise_BTA if self.config.prediction_type == "epsilon" else actions_BTA.float()
        squared_error_BTA = (prediction_BTA.float() - target_BTA) ** 2
        if self.config.do_mask_loss_for_padding and "action_is_pad" in batch:
            squared_error_BTA = torch.where(batch["action_is_pad"][..., None], 0.0, squared_error_BTA)
        return squared_error_BTA.mean(), {}

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, Tensor]) -> Tensor:
        """Denoise Gaussian noise into a (B, horizon, A) chunk, conditioned on the observation history."""
        self._check_inputs(batch, need_action=False)
        cond_BG = self.obs_encoder(self._crop(batch, None))
        sample_BTA = torch.randn(cond_BG.shape[0], self.config.horizon, self.action_dim, device=cond_BG.device)
        for timestep in self.noise_schedule.inference_timesteps():
            timesteps_B = torch.full((cond_BG.shape[0],), timestep, device=cond_BG.device, dtype=torch.long)
            prediction_BTA = self.unet(sample_BTA.to(cond_BG.dtype), timesteps_B, cond_BG).float()
            sample_BTA = self.noise_schedule.step(prediction_BTA, timestep, sample_BTA)
        return sample_BTA
