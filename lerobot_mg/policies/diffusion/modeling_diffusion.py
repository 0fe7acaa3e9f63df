"""Diffusion Policy (Chi et al. 2023, "Diffusion Policy: Visuomotor Policy Learning via Action Diffusion") as
LeRobot 0.6.1 builds it: the same modules, state_dict keys, buffers and arithmetic, so LeRobot's checkpoints load
here and give its numbers, and ours load there.

Training (DDPM objective): a chunk of `horizon` actions is noised to a random timestep by diffusers' scheduler and
the 1-D temporal convolutional U-Net predicts the noise (or the clean chunk), conditioned through FiLM on the
diffusion timestep and the observation features of the last `n_obs_steps` frames (states, each camera through a
ResNet18 + spatial softmax, environment states). Inference: start from Gaussian noise and denoise with diffusers'
DDPM or DDIM sampler over `num_inference_steps` steps.

Every random draw of a training sample (timestep, noise, image crop) comes from a generator seeded by the
sample's own seed (`SAMPLE_SEED_KEY`), so one process, DDP, FSDP and gradient accumulation train on the same
noise and match each other; a batch without seeds draws them from the global RNG. Given the same noise and
timesteps, the loss is LeRobot's to the bit.

The network has no repeated block, so it declares no FSDP wrap units: sharded runs choose them by size
(`accelerator.fsdp.min_num_params`) or by class (`accelerator.fsdp.wrap_modules`). It declares the blocks that
activation checkpointing recomputes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lerobot_mg.config.choices import VisionBackbone
from lerobot_mg.config.diffusion import DiffusionConfig
from lerobot_mg.errors import config_error
from lerobot_mg.policies.base import SAMPLE_SEED_KEY, FeatureSpec, PreTrainedPolicy
from lerobot_mg.policies.vision import (
    RESNET18_OUT_CHANNELS,
    ResNetNorm,
    load_resnet18_weights,
    resnet18_trunk,
)
from lerobot_mg.policies.vision import (
    VisionBackbone as LeRobotMgCnn,
)

# torchvision's ResNet18 children -> their index in LeRobot's truncated nn.Sequential (relu 2 and maxpool 3 have no
# weights).
_TRUNK_INDEX = {"conv1": "0", "bn1": "1", "layer1": "4", "layer2": "5", "layer3": "6", "layer4": "7"}
_RESNET18_HALVINGS = 5  # conv1, maxpool, layer2..layer4


def make_noise_scheduler(config: DiffusionConfig) -> DDPMScheduler | DDIMScheduler:
    """diffusers' scheduler with the arguments LeRobot passes (the rest at diffusers' defaults)."""
    scheduler_class = DDIMScheduler if config.noise_scheduler_type == "DDIM" else DDPMScheduler
    return scheduler_class(
        num_train_timesteps=config.num_train_timesteps,
        beta_start=config.beta_start,
        beta_end=config.beta_end,
        beta_schedule=str(config.beta_schedule),
        clip_sample=config.clip_sample,
        clip_sample_range=config.clip_sample_range,
        prediction_type=str(config.prediction_type),
    )


def _halved(size: int, times: int) -> int:
    """The size after ``times`` stride-2 convolutions (or poolings) that pad to keep ceil(size / 2)."""
    for _ in range(times):
        size = (size - 1) // 2 + 1
    return size


# --- observation encoder ---------------------------------------------------------------------------------


class SpatialSoftmax(nn.Module):
    """Keypoints of a feature map (Finn et al. 2016): a 1x1 conv to K maps (``nets``), a softmax over each map's
    pixels and the expected (x, y) position in [-1, 1] under it, on the ``pos_grid`` buffer (H*W, 2) built with
    numpy as LeRobot builds it. (B, C, H, W) -> (B, K, 2)."""

    def __init__(self, feature_map_chw: tuple[int, int, int], num_keypoints: int) -> None:
        super().__init__()
        channels, self._height, self._width = feature_map_chw
        self.num_keypoints = num_keypoints
        self.nets = nn.Conv2d(channels, num_keypoints, kernel_size=1)
        pos_x, pos_y = np.meshgrid(np.linspace(-1.0, 1.0, self._width), np.linspace(-1.0, 1.0, self._height))
        grid = np.stack([pos_x.reshape(-1), pos_y.reshape(-1)], axis=1)
        self.register_buffer("pos_grid", torch.from_numpy(grid).float())

    def forward(self, features_BCHW: Tensor) -> Tensor:
        maps = self.nets(features_BCHW).reshape(-1, self._height * self._width)
        # float32 softmax and expectation whatever the compute dtype (a no-op in float32).
        attention = F.softmax(maps.float(), dim=-1)
        return (attention @ self.pos_grid.float()).view(-1, self.num_keypoints, 2).to(features_BCHW.dtype)


def _load_pretrained_trunk(backbone: nn.Sequential, weights: str) -> None:
    """torchvision's ResNet18 weights into LeRobot's truncated trunk: a local file, or torchvision's weight name."""
    if Path(weights).is_file():
        state = load_resnet18_weights(Path(weights))
    else:
        try:  # torchvision is optional (its wheels are CUDA-linked): only a weight name needs it
            import torchvision
        except ImportError as error:
            raise config_error(
                "policy.pretrained_backbone_weights", weights,
                f"is no file, and as a torchvision weight name it needs torchvision ({error})",
                "policy.pretrained_backbone_weights=<path to resnet18-f37072fd.pth>",
            ) from error
        state = torchvision.models.get_weight(weights).get_state_dict(progress=False)
        state = {key: value for key, value in state.items() if not key.startswith("fc.")}
    renamed = {}
    for key, value in state.items():
        child, _, rest = key.partition(".")
        renamed[f"{_TRUNK_INDEX[child]}.{rest}"] = value
    backbone.load_state_dict(renamed, strict=True)


class DiffusionRgbEncoder(nn.Module):
    """Resize, crop, backbone, spatial softmax, linear + ReLU: (N, C, H, W) -> (N, 2 * num_keypoints).

    The crop is at the centre unless ``corners`` (one (top, left) per image) are given: the random crop of
    training, each sample's own.
    """

    def __init__(self, config: DiffusionConfig, image_chw: list[int], load_weights: bool) -> None:
        super().__init__()
        channels, height, width = image_chw
        self.resize_shape = None if config.resize_shape is None else tuple(config.resize_shape)
        self.crop_shape = config.image_crop_shape
        if self.crop_shape is not None:
            height, width = self.crop_shape
        elif self.resize_shape is not None:
            height, width = self.resize_shape
        self.backbone: nn.Module
        if config.vision_backbone == VisionBackbone.resnet18:
            norm = ResNetNorm.GROUP_NORM if config.use_group_norm else ResNetNorm.BATCH_NORM
            self.backbone = resnet18_trunk(norm, channels)
            if load_weights and config.pretrained_backbone_weights is not None:
                _load_pretrained_trunk(self.backbone, config.pretrained_backbone_weights)
            feature_map = (RESNET18_OUT_CHANNELS, _halved(height, _RESNET18_HALVINGS), _halved(width, _RESNET18_HALVINGS))
        else:
            cnn = LeRobotMgCnn(channels, list(config.vision_channels))
            self.backbone = cnn
            halvings = len(config.vision_channels)  # the stem and every stage after the first
            feature_map = (cnn.num_out_channels, _halved(height, halvings), _halved(width, halvings))
        self.pool = SpatialSoftmax(feature_map, config.spatial_softmax_num_keypoints)
        self.feature_dim = 2 * config.spatial_softmax_num_keypoints
        self.out = nn.Linear(self.feature_dim, self.feature_dim)
        self.relu = nn.ReLU()

    def preprocess(self, images_NCHW: Tensor, corners: list[tuple[int, int]] | None = None) -> Tensor:
        if self.resize_shape is not None:  # torchvision's Resize on tensors: bilinear, antialiased
            images_NCHW = F.interpolate(images_NCHW, size=self.resize_shape, mode="bilinear", align_corners=False,
                                        antialias=True)
        if self.crop_shape is None:
            return images_NCHW
        crop_height, crop_width = self.crop_shape
        if corners is None:  # torchvision's CenterCrop rounds the offsets half to even
            height, width = images_NCHW.shape[-2:]
            top, left = int(round((height - crop_height) / 2.0)), int(round((width - crop_width) / 2.0))
            return images_NCHW[..., top : top + crop_height, left : left + crop_width]
        return torch.stack([image[..., top : top + crop_height, left : left + crop_width]
                            for image, (top, left) in zip(images_NCHW, corners, strict=True)])

    def forward(self, images_NCHW: Tensor, corners: list[tuple[int, int]] | None = None) -> Tensor:
        features = torch.flatten(self.pool(self.backbone(self.preprocess(images_NCHW, corners))), start_dim=1)
        return self.relu(self.out(features))


# --- the conditional U-Net -------------------------------------------------------------------------------


class DiffusionSinusoidalPosEmb(nn.Module):
    """(B,) diffusion timesteps -> (B, dim) [sin, cos] embedding (the transformer's 10000 base), float32."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, timesteps_B: Tensor) -> Tensor:
        half = self.dim // 2
        scale = math.log(10000) / (half - 1)
        frequencies = torch.exp(torch.arange(half, device=timesteps_B.device) * -scale)
        angles_BH = timesteps_B.unsqueeze(-1) * frequencies.unsqueeze(0)
        return torch.cat((angles_BH.sin(), angles_BH.cos()), dim=-1)


class DiffusionConv1dBlock(nn.Module):
    """Conv1d -> GroupNorm -> Mish, keeping the time length."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, n_groups: int = 8) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2),
            nn.GroupNorm(n_groups, out_channels),
            nn.Mish(),
        )

    def forward(self, x_BCT: Tensor) -> Tensor:
        return self.block(x_BCT)


class DiffusionConditionalResidualBlock1d(nn.Module):
    """Two Conv1dBlocks with FiLM between them: the conditioning gives a per-channel scale and bias (or a bias
    only without `use_film_scale_modulation`)."""

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, config: DiffusionConfig) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.use_film_scale_modulation = config.use_film_scale_modulation
        self.conv1 = DiffusionConv1dBlock(in_channels, out_channels, config.kernel_size, config.n_groups)
        cond_channels = 2 * out_channels if self.use_film_scale_modulation else out_channels
        self.cond_encoder = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, cond_channels))
        self.conv2 = DiffusionConv1dBlock(out_channels, out_channels, config.kernel_size, config.n_groups)
        self.residual_conv: nn.Module = (
            nn.Conv1d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()
        )

    def forward(self, x_BCT: Tensor, cond_BD: Tensor) -> Tensor:
        out = self.conv1(x_BCT)
        film = self.cond_encoder(cond_BD).unsqueeze(-1)
        if self.use_film_scale_modulation:
            out = film[:, : self.out_channels] * out + film[:, self.out_channels :]
        else:
            out = out + film
        return self.conv2(out) + self.residual_conv(x_BCT)


class DiffusionConditionalUnet1d(nn.Module):
    """The denoiser: (noisy actions (B, T, A), timesteps (B,), global conditioning (B, G)) -> (B, T, A).

    Levels of `down_dims` widths: two residual blocks each, every level but the last halving T; two middle
    blocks; an up path that concatenates the skip of the matching level and doubles T; a final conv block.
    As in the original (and LeRobot), the first level's skip is not used by the up path.
    """

    def __init__(self, config: DiffusionConfig, action_dim: int, global_cond_dim: int) -> None:
        super().__init__()
        embed_dim = config.diffusion_step_embed_dim
        self.gradient_checkpointing = config.gradient_checkpointing
        self.diffusion_step_encoder = nn.Sequential(
            DiffusionSinusoidalPosEmb(embed_dim),
            nn.Linear(embed_dim, 4 * embed_dim),
            nn.Mish(),
            nn.Linear(4 * embed_dim, embed_dim),
        )
        cond_dim = embed_dim + global_cond_dim
        levels = [(action_dim, config.down_dims[0]), *zip(config.down_dims[:-1], config.down_dims[1:])]

        def block(in_channels: int, out_channels: int) -> DiffusionConditionalResidualBlock1d:
            return DiffusionConditionalResidualBlock1d(in_channels, out_channels, cond_dim, config)

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
            DiffusionConv1dBlock(first, first, config.kernel_size), nn.Conv1d(first, action_dim, 1)
        )

    def _block(self, block: nn.Module, x_BCT: Tensor, cond_BD: Tensor) -> Tensor:
        if self.gradient_checkpointing and self.training:
            return checkpoint(block, x_BCT, cond_BD, use_reentrant=False)
        return block(x_BCT, cond_BD)

    def forward(self, noisy_BTA: Tensor, timesteps_B: Tensor, global_cond_BG: Tensor) -> Tensor:
        # Compute in the dtype of the incoming sample (FSDP's mixed precision casts inputs at unit boundaries).
        x_BCT = noisy_BTA.transpose(1, 2)
        step_embedding = self.diffusion_step_encoder[0](timesteps_B).to(x_BCT.dtype)
        for layer in list(self.diffusion_step_encoder)[1:]:
            step_embedding = layer(step_embedding)
        cond_BD = torch.cat([step_embedding, global_cond_BG.to(x_BCT.dtype)], dim=-1)
        skips = []
        for first_block, second_block, downsample in self.down_modules:
            x_BCT = self._block(second_block, self._block(first_block, x_BCT, cond_BD), cond_BD)
            skips.append(x_BCT)
            x_BCT = downsample(x_BCT)
        for mid_block in self.mid_modules:
            x_BCT = self._block(mid_block, x_BCT, cond_BD)
        for first_block, second_block, upsample in self.up_modules:
            x_BCT = torch.cat([x_BCT, skips.pop()], dim=1)
            x_BCT = upsample(self._block(second_block, self._block(first_block, x_BCT, cond_BD), cond_BD))
        # A copy, not a view: FSDP2 warns that an in-place op on a unit's view output would skip its hooks.
        return self.final_conv(x_BCT).transpose(1, 2).contiguous()


# --- the diffusion model (LeRobot's `policy.diffusion`) --------------------------------------------------


Corners = dict[str, list[tuple[int, int]]]  # per camera key, one (top, left) crop corner per sample


class DiffusionModel(nn.Module):
    """Observation encoders, the U-Net and the noise scheduler: LeRobot's ``DiffusionModel`` (the policy's
    ``diffusion`` child, hence the ``diffusion.`` prefix of every state_dict key).

    The global conditioning of a sample is, per observation step, [state features, camera features (camera by
    camera), environment state features], flattened over the steps: (B, n_obs_steps * per-step features).
    """

    def __init__(self, config: DiffusionConfig, input_features: dict[str, FeatureSpec], action_dim: int,
                 load_backbone_weights: bool) -> None:
        super().__init__()
        self.config = config
        self.action_dim = action_dim
        self.state_keys = [key for key, spec in input_features.items() if spec["type"] == "STATE"]
        self.image_keys = [key for key, spec in input_features.items() if spec["type"] == "VISUAL"]
        self.env_keys = [key for key, spec in input_features.items() if spec["type"] == "ENV"]
        for key in self.state_keys + self.env_keys:
            if len(input_features[key]["shape"]) != 1:
                raise config_error("policy.observation_keys", list(input_features),
                                   f"Diffusion takes 1-D state features, but {key!r} has shape "
                                   f"{list(input_features[key]['shape'])}", f"leave {key!r} out of policy.observation_keys")
        per_step_dim = sum(int(input_features[key]["shape"][0]) for key in self.state_keys + self.env_keys)
        if self.image_keys:
            image_chw = list(input_features[self.image_keys[0]]["shape"])
            shapes = {key: list(input_features[key]["shape"]) for key in self.image_keys}
            if any(shape != image_chw for shape in shapes.values()):
                raise config_error(
                    "policy.observation_keys", list(input_features),
                    f"Diffusion (as LeRobot's) needs every camera of the same shape; got {shapes}",
                    "policy.observation_keys=<the cameras of one shape, and the states>",
                )
            if config.use_separate_rgb_encoder_per_camera:
                self.rgb_encoder: nn.Module = nn.ModuleList(
                    DiffusionRgbEncoder(config, image_chw, load_backbone_weights) for _ in self.image_keys
                )
                feature_dim = self.rgb_encoder[0].feature_dim
            else:
                self.rgb_encoder = DiffusionRgbEncoder(config, image_chw, load_backbone_weights)
                feature_dim = self.rgb_encoder.feature_dim
            per_step_dim += feature_dim * len(self.image_keys)
        self.global_cond_dim = per_step_dim * config.n_obs_steps
        self.unet = DiffusionConditionalUnet1d(config, action_dim, self.global_cond_dim)
        if config.compile_model:
            self.unet.compile(mode=config.compile_mode)  # in place: the state_dict keys stay the same
        self.noise_scheduler = make_noise_scheduler(config)

    def _image_features(self, batch: dict[str, Tensor], corners: Corners | None) -> Tensor:
        """(B, S, cameras * feature_dim): each camera's frames through its encoder in one call (in training, batch
        norm's statistics are those of all B * S frames, as in LeRobot)."""
        batch_size, num_steps = batch[self.image_keys[0]].shape[:2]

        def frame_corners(keys: list[str]) -> list[tuple[int, int]] | None:
            if corners is None:
                return None  # (b, s, camera) order, as the frames are flattened
            return [corners[key][sample] for sample in range(batch_size) for _ in range(num_steps) for key in keys]

        if isinstance(self.rgb_encoder, nn.ModuleList):
            per_camera = [
                encoder(batch[key].flatten(0, 1), frame_corners([key])).reshape(batch_size, num_steps, -1)
                for encoder, key in zip(self.rgb_encoder, self.image_keys, strict=True)
            ]
            return torch.cat(per_camera, dim=-1)
        frames = torch.stack([batch[key] for key in self.image_keys], dim=2).flatten(0, 2)
        return self.rgb_encoder(frames, frame_corners(self.image_keys)).reshape(batch_size, num_steps, -1)

    def global_conditioning(self, batch: dict[str, Tensor], corners: Corners | None = None) -> Tensor:
        features = [batch[key] for key in self.state_keys]
        if self.image_keys:
            features.append(self._image_features(batch, corners))
        features.extend(batch[key] for key in self.env_keys)
        return torch.cat(features, dim=-1).flatten(start_dim=1)

    def compute_loss(self, batch: dict[str, Tensor], eps_BTA: Tensor, timesteps_B: Tensor,
                     corners: Corners | None = None) -> Tensor:
        """LeRobot's loss given the noise and timesteps: mean squared error of the U-Net's prediction (the noise,
        or the clean chunk), over every entry, or with `do_mask_loss_for_padding` over the in-episode ones."""
        cond_BG = self.global_conditioning(batch, corners)
        trajectory_BTA = batch["action"]
        noisy_BTA = self.noise_scheduler.add_noise(trajectory_BTA, eps_BTA, timesteps_B)
        prediction_BTA = self.unet(noisy_BTA, timesteps_B, cond_BG).to(eps_BTA.dtype)
        target_BTA = eps_BTA if self.config.prediction_type == "epsilon" else trajectory_BTA
        loss_BTA = F.mse_loss(prediction_BTA, target_BTA, reduction="none")
        if self.config.do_mask_loss_for_padding:
            mask_BT1 = ~batch["action_is_pad"].unsqueeze(-1)
            return (loss_BTA * mask_BT1).sum() / (mask_BT1.sum() * loss_BTA.shape[-1]).clamp_min(1)
        return loss_BTA.mean()

    def conditional_sample(self, cond_BG: Tensor, noise_BTA: Tensor | None = None,
                           generator: torch.Generator | None = None) -> Tensor:
        """The scheduler's reverse process from `noise_BTA` (else fresh Gaussian noise) to a (B, horizon, A)
        chunk; float32 samples whatever the U-Net's dtype."""
        if noise_BTA is None:
            noise_BTA = torch.randn(cond_BG.shape[0], self.config.horizon, self.action_dim, device=cond_BG.device,
                                    generator=generator)
        sample_BTA = noise_BTA
        self.noise_scheduler.set_timesteps(self.config.inference_steps)
        for timestep in self.noise_scheduler.timesteps:
            timesteps_B = torch.full(sample_BTA.shape[:1], timestep, dtype=torch.long, device=sample_BTA.device)
            output_BTA = self.unet(sample_BTA.to(cond_BG.dtype), timesteps_B, cond_BG).to(sample_BTA.dtype)
            sample_BTA = self.noise_scheduler.step(output_BTA, timestep, sample_BTA, generator=generator).prev_sample
        return sample_BTA


# --- the policy ------------------------------------------------------------------------------------------


class DiffusionPolicy(PreTrainedPolicy):
    """LeRobot's ``DiffusionPolicy``: its state_dict is ``diffusion.rgb_encoder.*`` (one encoder per camera with
    ``use_separate_rgb_encoder_per_camera``), ``diffusion.unet.*``.

    ``load_backbone_weights=False`` builds it without reading ``pretrained_backbone_weights``: what a policy about
    to receive a checkpoint's weights wants (the checkpoint holds the trained backbone).
    """

    name: ClassVar[str] = "diffusion"
    config_class: ClassVar[type] = DiffusionConfig
    # Activation checkpointing recomputes each residual block (and each image-backbone block): size-based wrap
    # units would be single convolutions (nothing to save) or the whole U-Net (everything recomputed at once).
    _checkpoint_modules: ClassVar[list[str]] = ["DiffusionConditionalResidualBlock1d", "ResNetBasicBlock", "BasicBlock"]

    def __init__(
        self,
        config: DiffusionConfig,
        input_features: dict[str, FeatureSpec],
        output_features: dict[str, FeatureSpec],
        *,
        load_backbone_weights: bool = True,
    ) -> None:
        super().__init__(config, input_features, output_features)
        self.config: DiffusionConfig = config
        if "action" not in output_features or len(output_features["action"]["shape"]) != 1:
            raise config_error("output_features", output_features, "Diffusion needs a 1-D 'action' output feature",
                               "a dataset (dataset.root) whose 'action' feature is 1-D")
        self.action_dim = int(output_features["action"]["shape"][0])
        self.image_keys = [key for key, spec in self.input_features.items() if spec["type"] == "VISUAL"]
        self._check_image_sizes()
        self.diffusion = DiffusionModel(config, self.input_features, self.action_dim,  # type: ignore[arg-type]
                                        load_backbone_weights)

    def _image_hw(self) -> tuple[int, int] | None:
        """The (height, width) the crop is taken from: the resized size, else the cameras' own."""
        if not self.image_keys:
            return None
        if self.config.resize_shape is not None:
            return int(self.config.resize_shape[0]), int(self.config.resize_shape[1])
        _, height, width = self.input_features[self.image_keys[0]]["shape"]
        return int(height), int(width)

    def _check_image_sizes(self) -> None:
        crop, image_hw = self.config.image_crop_shape, self._image_hw()
        if crop is None or image_hw is None:
            return
        height, width = image_hw
        if crop[0] > height or crop[1] > width:
            raise config_error(
                "policy.crop_shape", list(crop), f"is larger than the images of {self.image_keys} ({height}x{width})",
                f"policy.crop_shape=[{height},{width}], or policy.crop_shape=null",
            )

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

    def _training_draws(self, batch: dict[str, Tensor], batch_size: int) -> tuple[Tensor, Tensor, Corners | None]:
        """(timesteps (B,), noise (B, horizon, A) float32, crop corners), each sample from its own seed. The crop
        is random in training mode only (LeRobot's RandomCrop), at the centre otherwise. The seeds stay on the host
        (step.HOST_KEYS); timesteps and noise are drawn on the batch's device from a generator of that device, the
        corners (Python ints) on the host: nothing waits for the device. On the CPU one generator draws all three
        in turn; a GPU's generator draws other numbers from the same seed."""
        seeds = batch.get(SAMPLE_SEED_KEY)
        if seeds is None:
            seeds = torch.randint(0, 2**62, (batch_size,))
        config = self.config
        crop, image_hw = config.image_crop_shape, self._image_hw()
        random_crop = self.training and config.crop_is_random and crop is not None and image_hw is not None
        timesteps, noises = [], []
        corners: Corners = {key: [] for key in self.image_keys}
        device = batch["action"].device
        for seed in seeds.tolist():
            # On the meta device (shapes only: the memory plan, the FLOPs count) a CPU one, which draws nothing there.
            generator = torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)
            timesteps.append(torch.randint(config.num_train_timesteps, (1,), generator=generator, device=device))
            noises.append(torch.randn(config.horizon, self.action_dim, generator=generator, device=device))
            if random_crop:
                host = generator if device.type == "cpu" else torch.Generator().manual_seed(seed)
                for key in self.image_keys:
                    top = int(torch.randint(image_hw[0] - crop[0] + 1, (1,), generator=host))
                    left = int(torch.randint(image_hw[1] - crop[1] + 1, (1,), generator=host))
                    corners[key].append((top, left))
        return torch.cat(timesteps), torch.stack(noises), corners if random_crop else None

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """LeRobot's loss at each sample's own random timestep and noise (see DiffusionModel.compute_loss)."""
        self._check_inputs(batch, need_action=True)
        timesteps_B, eps_BTA, corners = self._training_draws(batch, batch["action"].shape[0])
        loss = self.diffusion.compute_loss(batch, eps_BTA, timesteps_B, corners)
        return loss, {}

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, Tensor], noise: Tensor | None = None) -> Tensor:
        """Denoise `noise` (B, horizon, A) (else fresh Gaussian noise) into a (B, horizon, A) chunk, conditioned
        on the observation history (centre crop, as in evaluation)."""
        self._check_inputs(batch, need_action=False)
        return self.diffusion.conditional_sample(self.diffusion.global_conditioning(batch), noise)

    @torch.no_grad()
    def generate_actions(self, batch: dict[str, Tensor], noise: Tensor | None = None) -> Tensor:
        """The n_action_steps actions from the current frame on, (B, n_action_steps, A): LeRobot's
        ``predict_action_chunk`` (its ``generate_actions``)."""
        start = self.config.n_obs_steps - 1
        return self.predict_action_chunk(batch, noise)[:, start : start + self.config.n_action_steps]
