"""ACT's configuration: the policy's hyper-parameters and the Hydra schema of the ``policy=act`` preset.

The fields are LeRobot 0.6.1's ``ACTConfig`` fields with its types and defaults (a LeRobot ``config.json`` of an
ACT policy reads into it, and ours writes one), except ``pretrained_backbone_weights``, null here so that nothing
is ever downloaded unasked. lerobot_mg's own extras are named in ``lerobot_mg_only_fields``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lerobot_mg.config.choices import (
    Activation,
    L1Reduction,
    NormalizationMode,
    OptimizerType,
    SchedulerType,
    VisionBackbone,
    check_choice,
)
from lerobot_mg.config.policy import PolicyConfig, check_positive_ints
from lerobot_mg.config.recipe import OptimizerConfig, ParamGroupConfig, SchedulerConfig, TrainingPreset
from lerobot_mg.errors import config_error

# The vision backbone's parameter names (as LeRobot's ACTPolicy names them; under PEFT they gain a prefix).
BACKBONE_PARAMETERS = "model.backbone."
# torchvision's name of the ImageNet ResNet18 weights LeRobot's ACT starts from (its default).
TORCHVISION_RESNET18_WEIGHTS = "ResNet18_Weights.IMAGENET1K_V1"


def _act_normalization_mapping() -> dict[str, NormalizationMode]:
    # LeRobot's ACT default: no ENV entry, so observation.environment_state is passed through unnormalized.
    return {
        "VISUAL": NormalizationMode.MEAN_STD,
        "STATE": NormalizationMode.MEAN_STD,
        "ACTION": NormalizationMode.MEAN_STD,
    }


@dataclass
class ACTConfig(PolicyConfig):
    """Action Chunking Transformer (Zhao et al. 2023), LeRobot 0.6.1's fields. ACT reads the current frame only
    (no observation history)."""

    action_length_key: ClassVar[str] = "chunk_size"
    policy_class_path: ClassVar[str] = "lerobot_mg.policies.act.modeling_act:ACTPolicy"
    # Fields LeRobot's ACTConfig lacks: they live in train_config.json, never in config.json.
    lerobot_mg_only_fields: ClassVar[frozenset[str]] = PolicyConfig.lerobot_mg_only_fields | {"l1_reduction"}
    camera_only_fields: ClassVar[dict[str, str]] = {"vision_backbone": VisionBackbone.resnet18.value}

    type: str = "act"
    chunk_size: int = 100
    n_action_steps: int = 100
    normalization_mapping: dict[str, NormalizationMode] = field(default_factory=_act_normalization_mapping)
    # resnet18: torchvision's ResNet18 with frozen batch norm, its layer4 feature map (LeRobot's ACT).
    # lerobot_mg_cnn: our small CNN (vision_channels), trained from scratch; such a checkpoint is ours only.
    vision_backbone: VisionBackbone = VisionBackbone.resnet18
    # ResNet18's ImageNet weights for a new policy: a local file (torchvision's resnet18-f37072fd.pth, or a
    # .safetensors copy), or torchvision's name ResNet18_Weights.IMAGENET1K_V1 where torchvision is installed and
    # online. null: random init. A policy loaded from a checkpoint takes the checkpoint's weights instead.
    pretrained_backbone_weights: str | None = None
    # LeRobot types it int and writes false, or 0 once read back: 0 and 1 are accepted (the schema reads them as
    # false and true). ResNet18's blocks cannot dilate (true fails).
    replace_final_stride_with_dilation: bool = False
    pre_norm: bool = False
    dim_model: int = 512
    n_heads: int = 8
    dim_feedforward: int = 3200
    feedforward_activation: Activation = Activation.relu
    n_encoder_layers: int = 4
    # The original ACT code builds 7 decoder layers but only runs the first one; 1 matches its behaviour.
    n_decoder_layers: int = 1
    use_vae: bool = True
    latent_dim: int = 32
    n_vae_encoder_layers: int = 4
    # Exponential weights exp(-coeff * i) over the chunks predicted at every step (needs n_action_steps=1).
    temporal_ensemble_coeff: float | None = None
    dropout: float = 0.1
    kl_weight: float = 10.0
    # LeRobot's training preset for ACT (training_preset: use_policy_training_preset), the backbone's lr included.
    optimizer_lr: float = 1e-5
    optimizer_weight_decay: float = 1e-4
    optimizer_lr_backbone: float = 1e-5
    # lerobot_mg only. valid_entries: LeRobot's mean over the non-padded entries. per_sample: padded entries count
    # as zero error, every sample weighs the same, so data-parallel runs equal one process on padded chunks.
    l1_reduction: L1Reduction = L1Reduction.valid_entries

    @property
    def action_delta_indices(self) -> list[int]:
        """Frame offsets of the action chunk the dataset must load for each sample."""
        return list(range(self.chunk_size))

    def training_preset(self) -> TrainingPreset:
        """LeRobot's: AdamW (its other defaults: betas (0.9, 0.999), eps 1e-8, clip 10) at ``optimizer_lr`` and
        ``optimizer_weight_decay``, the vision backbone's parameters at ``optimizer_lr_backbone`` (ACTPolicy's
        get_optim_params), and no lr schedule."""
        return TrainingPreset(
            OptimizerConfig(type=OptimizerType.adamw, lr=self.optimizer_lr, betas=[0.9, 0.999],
                             eps=1e-8, weight_decay=self.optimizer_weight_decay, grad_clip_norm=10.0,
                             param_groups=[ParamGroupConfig(match=BACKBONE_PARAMETERS, lr=self.optimizer_lr_backbone)]),
            SchedulerConfig(type=SchedulerType.none),
        )

    def check_fields(self) -> None:
        positive_ints = {
            "chunk_size": self.chunk_size,
            "dim_model": self.dim_model,
            "n_heads": self.n_heads,
            "dim_feedforward": self.dim_feedforward,
            "n_encoder_layers": self.n_encoder_layers,
            "n_decoder_layers": self.n_decoder_layers,
            "latent_dim": self.latent_dim,
        }
        if self.use_vae:
            positive_ints["n_vae_encoder_layers"] = self.n_vae_encoder_layers
        check_positive_ints(positive_ints)
        if self.n_obs_steps != 1:
            raise config_error("policy.n_obs_steps", self.n_obs_steps,
                               "must be 1: ACT reads the current frame only (as LeRobot's)", "policy.n_obs_steps=1")
        if self.n_action_steps > self.chunk_size:
            raise config_error(
                "policy.n_action_steps", self.n_action_steps,
                f"exceeds policy.chunk_size={self.chunk_size}: a chunk cannot feed more steps than it holds",
                f"policy.n_action_steps={self.chunk_size}",
            )
        if self.dim_model % self.n_heads != 0:
            heads = next(k for k in range(self.n_heads, 0, -1) if self.dim_model % k == 0)
            raise config_error(
                "policy.dim_model", self.dim_model,
                f"is not divisible by policy.n_heads={self.n_heads} (each head gets dim_model / n_heads features)",
                f"policy.n_heads={heads}",
            )
        check_choice("policy.feedforward_activation", self.feedforward_activation, Activation)
        check_choice("policy.vision_backbone", self.vision_backbone, VisionBackbone)
        check_choice("policy.l1_reduction", self.l1_reduction, L1Reduction)
        if not 0.0 <= self.dropout < 1.0:
            raise config_error("policy.dropout", self.dropout, "must be in [0, 1)", "policy.dropout=0.1")
        if self.kl_weight < 0:
            raise config_error("policy.kl_weight", self.kl_weight, "must be >= 0", "policy.kl_weight=10")
        self._check_backbone()
        if self.temporal_ensemble_coeff is not None and self.n_action_steps != 1:
            raise config_error(
                "policy.n_action_steps", self.n_action_steps,
                f"must be 1 with policy.temporal_ensemble_coeff={self.temporal_ensemble_coeff} (the ensemble "
                "predicts a chunk at every step and runs its first action)",
                "policy.n_action_steps=1, or policy.temporal_ensemble_coeff=null",
            )

    def _check_backbone(self) -> None:
        dilation = self.replace_final_stride_with_dilation
        if dilation not in (0, 1):  # False == 0, True == 1
            raise config_error("policy.replace_final_stride_with_dilation", dilation,
                               "must be false or true (0 or 1)", "policy.replace_final_stride_with_dilation=false")
        weights = self.pretrained_backbone_weights
        if weights is not None and self.vision_backbone != VisionBackbone.resnet18:
            raise config_error(
                "policy.pretrained_backbone_weights", weights,
                f"are ResNet18 weights, but policy.vision_backbone={self.vision_backbone} (trained from scratch)",
                "policy.pretrained_backbone_weights=null, or policy.vision_backbone=resnet18",
            )
