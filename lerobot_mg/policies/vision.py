"""The image backbones the policies share.

- ResNet18 as torchvision and LeRobot build it (:class:`ResNet18FeatureMap` for ACT, :func:`resnet18_trunk` for
  Diffusion Policy), with torchvision's parameter names, so LeRobot checkpoints and torchvision's ImageNet weights
  load into it.
- Our own small ResNet-style network (:class:`VisionBackbone`), trained from scratch: GroupNorm instead of
  BatchNorm (no running statistics to keep in sync across data-parallel ranks, results that do not depend on the
  per-rank batch size), a tenth of ResNet18's parameters. A checkpoint that uses it is lerobot_mg's only.
"""

from __future__ import annotations

import enum
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn


def group_norm(num_channels: int) -> nn.GroupNorm:
    # gcd keeps any channel count valid; 32 groups is the usual choice for wide layers.
    return nn.GroupNorm(math.gcd(num_channels, 32), num_channels)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs + identity/projection shortcut), GroupNorm."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = group_norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), group_norm(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class VisionBackbone(nn.Module):
    """Stride-2 stem then one BasicBlock per stage width; every stage after the first halves H and W."""

    def __init__(self, in_channels: int, stage_channels: list[int]) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, stage_channels[0], 3, stride=2, padding=1, bias=False),
            group_norm(stage_channels[0]),
            nn.ReLU(),
        )
        blocks = []
        previous = stage_channels[0]
        for index, width in enumerate(stage_channels):
            blocks.append(BasicBlock(previous, width, stride=1 if index == 0 else 2))
            previous = width
        self.stages = nn.Sequential(*blocks)
        self.num_out_channels = previous

    def forward(self, images_BCHW: Tensor) -> Tensor:
        return self.stages(self.stem(images_BCHW))


# --- ResNet18 as torchvision builds it (LeRobot's ACT and Diffusion backbone) -------------------------------------
# Written here rather than imported: torchvision's wheels are built against CUDA torch, and a CPU-only environment
# cannot import them. The module and parameter names are torchvision's (conv1, bn1, layer1.0.conv1, ...,
# layer2.0.downsample.0), so torchvision's ImageNet weights and LeRobot's checkpoints load into it unchanged.


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with fixed statistics and affine parameters, all four kept as buffers (torchvision.ops.misc's
    layer, which LeRobot's ACT uses): nothing in it trains, and it has no ``num_batches_tracked``."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:  # type: ignore[no-untyped-def]
        state_dict.pop(prefix + "num_batches_tracked", None)  # a BatchNorm2d's weights load as well
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.weight.reshape(1, -1, 1, 1) * (self.running_var.reshape(1, -1, 1, 1) + self.eps).rsqrt()
        shift = self.bias.reshape(1, -1, 1, 1) - self.running_mean.reshape(1, -1, 1, 1) * scale
        # One pass over the activations instead of two (x * scale, then + shift); the same values.
        return torch.addcmul(shift, x, scale)


class ResNetNorm(enum.Enum):
    """The normalization layer of every ResNet18 block: LeRobot's ACT freezes batch norm; its Diffusion Policy
    trains batch norm, or replaces it by group norm (``use_group_norm``, ``num_features // 16`` groups)."""

    FROZEN_BATCH_NORM = "frozen_batch_norm"
    BATCH_NORM = "batch_norm"
    GROUP_NORM = "group_norm"

    def layer(self, num_features: int) -> nn.Module:
        if self is ResNetNorm.FROZEN_BATCH_NORM:
            return FrozenBatchNorm2d(num_features)
        if self is ResNetNorm.BATCH_NORM:
            return nn.BatchNorm2d(num_features)
        return nn.GroupNorm(num_features // 16, num_features)


class ResNetBasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 convs, a 1x1 projection (``downsample``) where the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: ResNetNorm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm.layer(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = norm.layer(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                            norm.layer(out_channels))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


RESNET18_OUT_CHANNELS = 512
_RESNET18_STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (width, stride of the stage's first block)


def resnet18_layers(norm: ResNetNorm, in_channels: int = 3) -> dict[str, nn.Module]:
    """torchvision's ``resnet18`` up to ``layer4`` (no average pool, no ``fc``), in its order: conv1, bn1, relu,
    maxpool, layer1..layer4. Total stride 32: a 96x96 image gives a 512 x 3 x 3 feature map. Initialised as
    torchvision initialises it (Kaiming-normal convs, unit norm weights)."""
    layers: dict[str, nn.Module] = {
        "conv1": nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
        "bn1": norm.layer(64),
        "relu": nn.ReLU(inplace=True),
        "maxpool": nn.MaxPool2d(3, stride=2, padding=1),
    }
    previous = 64
    for index, (width, stride) in enumerate(_RESNET18_STAGES, start=1):
        layers[f"layer{index}"] = nn.Sequential(ResNetBasicBlock(previous, width, stride, norm),
                                                ResNetBasicBlock(width, width, 1, norm))
        previous = width
    for layer in layers.values():
        for module in layer.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return layers


class ResNet18FeatureMap(nn.Module):
    """ResNet18 returning the ``layer4`` feature map (B, 512, H/32, W/32): the module LeRobot's ACT keeps as
    ``model.backbone`` (torchvision's IntermediateLayerGetter), with the same state_dict keys."""

    def __init__(self, norm: ResNetNorm = ResNetNorm.FROZEN_BATCH_NORM, in_channels: int = 3) -> None:
        super().__init__()
        for name, layer in resnet18_layers(norm, in_channels).items():
            self.add_module(name, layer)
        self.num_out_channels = RESNET18_OUT_CHANNELS

    def forward(self, images_BCHW: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(images_BCHW))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


def resnet18_trunk(norm: ResNetNorm = ResNetNorm.BATCH_NORM, in_channels: int = 3) -> nn.Sequential:
    """ResNet18 without its last two children, as an ``nn.Sequential`` numbered 0..7 (LeRobot's Diffusion Policy
    ``rgb_encoder.backbone``: keys ``0.weight`` (conv1), ``1.*`` (bn1), ``4.*``..``7.*`` (layer1..layer4))."""
    return nn.Sequential(*resnet18_layers(norm, in_channels).values())


def load_resnet18_weights(path: Path) -> dict[str, Tensor]:
    """torchvision's ResNet18 weights from a local file (``resnet18-f37072fd.pth`` as torchvision downloads it, or
    a ``.safetensors`` copy), without ``fc.*``: the state_dict of :func:`resnet18_layers` under torchvision's names.
    A ``.pth`` is read with ``torch.load(weights_only=True)``, which refuses anything but tensors."""
    if path.suffix == ".safetensors":
        weights = load_file(str(path))
    else:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    return {key: value for key, value in weights.items() if not key.startswith("fc.")}
