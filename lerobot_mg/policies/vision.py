"""Our own small ResNet-style image backbone, shared by the policies and trained from scratch (no downloaded
weights).

GroupNorm instead of BatchNorm: no running statistics to keep in sync across data-parallel ranks, and results
that do not depend on the per-rank batch size.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
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
