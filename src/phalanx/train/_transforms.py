"""Image transforms: the usual ImageNet recipes, as picklable objects.

:func:`train_transform` (random resized crop, random horizontal flip,
normalise) and :func:`eval_transform` (resize the short side, centre crop,
normalise) take a ``PIL.Image`` (or a ``uint8`` tensor ``(3, H, W)``) and
return a float tensor ``(3, H, W)``. The random numbers come from ``torch``'s
global generator, so ``torch.manual_seed`` and DataLoader worker seeding
make them reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from .._errors import InvalidArgumentError

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "EvalTransform", "TrainTransform", "eval_transform", "pil_to_tensor",
    "train_transform",
]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a ``uint8`` tensor ``(3, H, W)``."""
    array = np.array(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _as_pil(image: Any, call: str) -> Image.Image:
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, torch.Tensor) and image.dim() == 3 and image.shape[0] in (1, 3) \
            and image.dtype == torch.uint8:
        array = image.expand(3, -1, -1).permute(1, 2, 0).contiguous().numpy()
        return Image.fromarray(array, "RGB")
    raise InvalidArgumentError(
        f"{call}: expected a PIL image or a uint8 tensor (3, H, W), got {type(image).__name__}"
        + (f" {image.dtype} {list(image.shape)}" if isinstance(image, torch.Tensor) else "") + ".")


def _size(call: str, size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        pair: tuple[Any, ...] = (size, size)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        pair = tuple(size)
    else:
        raise InvalidArgumentError(f"{call}: size must be an int or (height, width), got {size!r}.")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in pair):
        raise InvalidArgumentError(f"{call}: size must be positive integers, got {size!r}.")
    return int(pair[0]), int(pair[1])


def _stats(call: str, name: str, values: Sequence[float], positive: bool) -> tuple[float, float, float]:
    try:
        triple = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        triple = ()
    if len(triple) != 3 or not all(math.isfinite(v) for v in triple) or (positive and min(triple) <= 0):
        raise InvalidArgumentError(
            f"{call}: {name} must be 3 finite numbers (one per RGB channel){', all > 0' if positive else ''}, "
            f"got {values!r}.")
    return triple


def _range(call: str, name: str, pair: Sequence[float], low: float, high: float) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in pair)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{call}: {name} must be a pair (low, high), got {pair!r}.") from None
    if not (low < a <= b <= high):
        raise InvalidArgumentError(f"{call}: {name} must satisfy {low} < low <= high <= {high}, got {pair!r}.")
    return a, b


def _normalised(image: Image.Image, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    array = np.asarray(image, dtype=np.float32) * np.float32(1 / 255)
    array = (array - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


class TrainTransform:
    """Random resized crop to ``size``, random horizontal flip, float tensor ``(3, H, W)``, normalised.

    Made by :func:`train_transform`. The crop covers a fraction of the area
    drawn from ``scale`` with an aspect ratio drawn (log-uniformly) from
    ``ratio``, as torchvision's ``RandomResizedCrop``; random numbers come
    from ``torch``'s global generator.
    """

    def __init__(self, size: int | Sequence[int] = 224, *, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), flip: bool = True,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        call = "phalanx.train.train_transform()"
        self.size = _size(call, size)
        self.scale = _range(call, "scale", scale, 0.0, 1.0)
        self.ratio = _range(call, "ratio", ratio, 0.0, math.inf)
        self.flip = bool(flip)
        self.mean = _stats(call, "mean", mean, positive=False)
        self.std = _stats(call, "std", std, positive=True)

    def crop_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """A random ``(left, top, right, bottom)`` crop of a ``width`` x ``height`` image."""
        area = width * height
        log_low, log_high = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_low, log_high).item())
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return left, top, left + w, top + h
        aspect = width / height  # fallback: the centre, clamped to the ratio range
        if aspect < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif aspect > self.ratio[1]:
            w, h = int(round(height * self.ratio[1])), height
        else:
            w, h = width, height
        top, left = (height - h) // 2, (width - w) // 2
        return left, top, left + w, top + h

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = _as_pil(image, "phalanx.train.train_transform()")
        box = self.crop_box(*image.size)
        out = image.resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR, box=box)
        if self.flip and torch.rand(1).item() < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _normalised(out, self.mean, self.std)

    def __repr__(self) -> str:
        return (f"train_transform(size={self.size}, scale={self.scale}, ratio=({self.ratio[0]:.4g}, "
                f"{self.ratio[1]:.4g}), flip={self.flip})")


class EvalTransform:
    """Resize the short side to ``resize``, centre crop ``size``, float tensor ``(3, H, W)``, normalised.

    Made by :func:`eval_transform`; deterministic. The resize and the crop are
    one bilinear (antialiased) resampling of the crop's source region.
    """

    def __init__(self, size: int | Sequence[int] = 224, *, resize: int | None = None,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        call = "phalanx.train.eval_transform()"
        self.size = _size(call, size)
        if resize is None:
            resize = int(round(max(self.size) * 256 / 224))
        if isinstance(resize, bool) or not isinstance(resize, int) or resize < max(self.size):
            raise InvalidArgumentError(
                f"{call}: resize (the short side before the centre crop) must be an int >= the crop size "
                f"{max(self.size)}, got {resize!r}.")
        self.resize = resize
        self.mean = _stats(call, "mean", mean, positive=False)
        self.std = _stats(call, "std", std, positive=True)

    def crop_box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """The source region ``(left, top, right, bottom)`` that resize-then-centre-crop keeps."""
        if width <= height:
            rw, rh = self.resize, int(self.resize * height / width)
        else:
            rw, rh = int(self.resize * width / height), self.resize
        ch, cw = self.size
        top, left = int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0))
        sx, sy = width / rw, height / rh
        return left * sx, top * sy, (left + cw) * sx, (top + ch) * sy

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = _as_pil(image, "phalanx.train.eval_transform()")
        box = self.crop_box(*image.size)
        out = image.resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR, box=box)
        return _normalised(out, self.mean, self.std)

    def __repr__(self) -> str:
        return f"eval_transform(size={self.size}, resize={self.resize})"


def train_transform(size: int | Sequence[int] = 224, *, scale: Sequence[float] = (0.08, 1.0),
                    ratio: Sequence[float] = (3 / 4, 4 / 3), flip: bool = True,
                    mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> TrainTransform:
    """The training transform: random resized crop to ``size`` (an int or ``(height, width)``) covering a
    ``scale`` fraction of the area, random horizontal flip, float tensor ``(3, H, W)`` normalised with
    ``mean``/``std``. The crop's aspect ratio is drawn log-uniformly from ``ratio``; random numbers come
    from torch's global generator. Returns a picklable :class:`TrainTransform`; raises
    :class:`InvalidArgumentError` for a bad size, range or statistics."""
    return TrainTransform(size, scale=scale, ratio=ratio, flip=flip, mean=mean, std=std)


def eval_transform(size: int | Sequence[int] = 224, *, resize: int | None = None,
                   mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> EvalTransform:
    """The evaluation transform: resize the short side to ``resize`` (default ``round(size * 256 / 224)``:
    256 for 224; the larger side of a ``(height, width)`` size), centre crop ``size``, float tensor
    ``(3, H, W)`` normalised with ``mean``/``std``; deterministic. Returns a picklable
    :class:`EvalTransform`; raises :class:`InvalidArgumentError` for a bad size or ``resize``."""
    return EvalTransform(size, resize=resize, mean=mean, std=std)
