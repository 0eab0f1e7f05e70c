"""ResNet-18/34/50 (He et al., 2015) with torchvision's architecture and parameter names, so that
`model.load_state_dict(torchvision.models.resnet50().state_dict())` loads and the parameter counts
are torchvision's (11,689,512, 21,797,672 and 25,557,032 with 1000 classes). torchvision itself is
not used: its PyPI wheels do not import beside the CPU build of torch. As in torchvision 0.13 and
later ("ResNet v1.5"), a bottleneck block strides in its 3x3 convolution."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

Arch = Literal["resnet18", "resnet34", "resnet50"]


def conv3x3(inputs: int, outputs: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inputs, outputs, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(inputs: int, outputs: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inputs, outputs, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inputs: int, planes: int, stride: int, downsample: nn.Module | None, norm) -> None:
        super().__init__()
        self.conv1 = conv3x3(inputs, planes, stride)
        self.bn1 = norm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inputs: int, planes: int, stride: int, downsample: nn.Module | None, norm) -> None:
        super().__init__()
        self.conv1 = conv1x1(inputs, planes)
        self.bn1 = norm(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = norm(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = norm(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


LAYOUTS: dict[str, tuple[type[nn.Module], tuple[int, int, int, int]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}


class ResNet(nn.Module):
    def __init__(
        self, arch: Arch = "resnet50", num_classes: int = 1000, width: int = 64, norm=nn.BatchNorm2d
    ):
        """`width`: channels of the stem and the first stage (torchvision's is 64; the stages double
        it); smaller only to make a debug run fast."""
        super().__init__()
        block, depths = LAYOUTS[arch]
        self.inplanes, self.norm = width, norm
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(block, width, depths[0], stride=1)
        self.layer2 = self._stage(block, width * 2, depths[1], stride=2)
        self.layer3 = self._stage(block, width * 4, depths[2], stride=2)
        self.layer4 = self._stage(block, width * 8, depths[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for module in self.modules():  # torchvision's initialisation
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d | nn.GroupNorm):
                nn.init.constant_(module.weight, 1)
                nn.init.constant_(module.bias, 0)

    def _stage(self, block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride), self.norm(planes * block.expansion)
            )
        layers = [block(self.inplanes, planes, stride, downsample, self.norm)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, 1, None, self.norm) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
