"""ResNets (He et al., 2015) with torchvision's architecture, parameter counts and initialisation.

::

    from phalanx.train import models

    model = models.resnet50(num_classes=1000)             # 25,557,032 parameters, as torchvision's
    model = models.resnet_tiny(num_classes=4)             # [1, 1, 1, 1] BasicBlocks, width 16: for CPUs
    model = phalanx.torch.convert_sync_batchnorm(model)   # every BatchNorm2d becomes SyncBatchNorm

The layers have torchvision's names (``conv1``, ``bn1``, ``layer1.0.conv1``,
..., ``fc``) and shapes, so a torchvision ``state_dict`` loads into the model
of the same depth. ``width`` scales every stage (64 → stages of 64, 128, 256,
512 channels), ``in_channels`` the input. ResNet-50 is "v1.5": the stride of
a downsampling bottleneck is on its 3x3 convolution. ``zero_init_residual``
starts the last BatchNorm of every residual branch at zero, so each block
starts as the identity (Goyal et al., 2017).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .._errors import InvalidArgumentError

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnet_tiny",
]

NormLayer = Callable[[int], nn.Module]


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution without bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, with a residual connection (ResNet-50+)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = norm_layer(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = norm_layer(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"phalanx.train.models.ResNet(): {name} must be an int >= 1, got {value!r}.")
    return value


class ResNet(nn.Module):
    """A ResNet: 7x7/2 stem and 3x3/2 max pool, four stages of ``layers[i]`` blocks (strides 1, 2, 2, 2),
    global average pool, linear classifier.

    ``block``: :class:`BasicBlock` or :class:`Bottleneck`. ``width``: channels
    of the stem and first stage (doubling per stage). ``norm_layer``: the
    normalisation constructor (``nn.BatchNorm2d``). Convolutions get Kaiming
    normal initialisation (``fan_out``, ReLU), norms weight 1 and bias 0, the
    classifier torch's default, as in torchvision.
    """

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: Sequence[int], num_classes: int = 1000, *,
                 width: int = 64, in_channels: int = 3, zero_init_residual: bool = False,
                 norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        if block not in (BasicBlock, Bottleneck) and not (isinstance(block, type) and hasattr(block, "expansion")):
            raise InvalidArgumentError(
                f"phalanx.train.models.ResNet(): block must be BasicBlock or Bottleneck, got {block!r}.")
        if isinstance(layers, (str, bytes)) or len(layers) != 4:
            raise InvalidArgumentError(
                f"phalanx.train.models.ResNet(): layers must be 4 block counts (e.g. [2, 2, 2, 2]), got {layers!r}.")
        counts = [_positive("every entry of layers", n) for n in layers]
        num_classes = _positive("num_classes", num_classes)
        width = _positive("width", width)
        in_channels = _positive("in_channels", in_channels)
        self._norm_layer = norm_layer
        self.inplanes = width
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, counts[0])
        self.layer2 = self._make_layer(block, width * 2, counts[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, counts[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, counts[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                last = m.bn3 if isinstance(m, Bottleneck) else m.bn2 if isinstance(m, BasicBlock) else None
                weight = getattr(last, "weight", None)
                if isinstance(weight, torch.Tensor):
                    nn.init.constant_(weight, 0)

    def _make_layer(self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int,
                    stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       self._norm_layer(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample, self._norm_layer)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, norm_layer=self._norm_layer) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled features ``(N, width * 8 * expansion)`` before the classifier."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def resnet18(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-18: BasicBlocks [2, 2, 2, 2] (11,689,512 parameters at 1000 classes)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, **kwargs)


def resnet34(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-34: BasicBlocks [3, 4, 6, 3] (21,797,672 parameters at 1000 classes)."""
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes, **kwargs)


def resnet50(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-50: Bottlenecks [3, 4, 6, 3] (25,557,032 parameters at 1000 classes)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, **kwargs)


def resnet101(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-101: Bottlenecks [3, 4, 23, 3] (44,549,160 parameters at 1000 classes)."""
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes, **kwargs)


def resnet152(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-152: Bottlenecks [3, 8, 36, 3] (60,192,808 parameters at 1000 classes)."""
    return ResNet(Bottleneck, [3, 8, 36, 3], num_classes, **kwargs)


def resnet_tiny(num_classes: int = 10, width: int = 16, **kwargs: Any) -> ResNet:
    """A small ResNet for CPUs and tests: BasicBlocks [1, 1, 1, 1], stages of ``width`` .. ``8 * width``
    channels (310,746 parameters at 10 classes and width 16)."""
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes, width=width, **kwargs)
