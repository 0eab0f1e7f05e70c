"""torchvision.models' ResNet constructors, as hvdtrain's ResNet: torchvision's architecture, parameter
names and initialisation, with no pretrained weights (nothing can be downloaded here)."""

from __future__ import annotations

from hvdtrain.models.resnet import Arch, ResNet


def _resnet(arch: Arch, weights: object, num_classes: int) -> ResNet:
    if weights is not None:
        raise ValueError(f"{arch}: pretrained weights cannot be had here; this torchvision is a stand-in")
    return ResNet(arch, num_classes=num_classes)


def resnet18(*, weights: object = None, num_classes: int = 1000) -> ResNet:
    return _resnet("resnet18", weights, num_classes)


def resnet34(*, weights: object = None, num_classes: int = 1000) -> ResNet:
    return _resnet("resnet34", weights, num_classes)


def resnet50(*, weights: object = None, num_classes: int = 1000) -> ResNet:
    return _resnet("resnet50", weights, num_classes)
