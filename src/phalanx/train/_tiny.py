"""A tiny, learnable ImageNet: real JPEG files in Kaggle's ImageNet layout, generated from a seed.

::

    root = phalanx.train.make_tiny_imagenet("data/tiny-imagenet", classes=4)
    train = phalanx.train.ImageNet(root, "train", phalanx.train.train_transform(56, scale=(0.35, 1)))

    python -m phalanx.train._tiny data/tiny-imagenet --classes 10 --train-per-class 100

The tree is what :class:`phalanx.train.ImageNet` reads from the real dataset::

    LOC_synset_mapping.txt       n01440764 tench, Tinca tinca     (real synsets for the first 20 classes)
    LOC_train_solution.csv       ImageId,PredictionString         (3 of every 4 train images, shuffled,
    LOC_val_solution.csv                                          as the real file lists only some)
    ILSVRC/Data/CLS-LOC/train/<synset>/<synset>_<i>.JPEG          i = 1 .. train_per_class
    ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_<i:08d>.JPEG           classes shuffled over i = 1 .. N

Every image shows an ellipse in its class's colour, striped at the class's
angle, at a random place and size over a blotchy random background tinted
with the class's colour, plus pixel noise; the ``PredictionString`` box is the
ellipse's. So a small CNN learns it in a few epochs on a CPU, even from the
small crops of :func:`~phalanx.train.train_transform`'s default scale. The
images depend only on ``seed`` and the image's identity, not on the order of
writing. Files are written atomically and a marker file last: a complete tree
is left alone (calling again is cheap), and several processes may build the
same tree at once.
"""

from __future__ import annotations

import argparse
import colorsys
import io
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from .._errors import InvalidArgumentError
from .._files import write_atomically

__all__ = ["make_tiny_imagenet"]

MARKER = ".phalanx-tiny-imagenet.json"
_VERSION = 1
_MAX_CLASSES = 1000
_TRAIN, _VAL, _ORDER = 1, 2, 3  # seed streams

# The first 20 lines of the real LOC_synset_mapping.txt.
_SYNSETS = [
    ("n01440764", "tench, Tinca tinca"),
    ("n01443537", "goldfish, Carassius auratus"),
    ("n01484850", "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias"),
    ("n01491361", "tiger shark, Galeocerdo cuvieri"),
    ("n01494475", "hammerhead, hammerhead shark"),
    ("n01496331", "electric ray, crampfish, numbfish, torpedo"),
    ("n01498041", "stingray"),
    ("n01514668", "cock"),
    ("n01514859", "hen"),
    ("n01518878", "ostrich, Struthio camelus"),
    ("n01530575", "brambling, Fringilla montifringilla"),
    ("n01531178", "goldfinch, Carduelis carduelis"),
    ("n01532829", "house finch, linnet, Carpodacus mexicanus"),
    ("n01534433", "junco, snowbird"),
    ("n01537544", "indigo bunting, indigo finch, indigo bird, Passerina cyanea"),
    ("n01558993", "robin, American robin, Turdus migratorius"),
    ("n01560419", "bulbul"),
    ("n01580077", "jay"),
    ("n01582220", "magpie"),
    ("n01592084", "chickadee"),
]


def synsets(classes: int) -> list[tuple[str, str]]:
    """``(synset id, name)`` of the tiny tree's classes: real ones first, then ``n09xxxxxx`` made up."""
    made_up = [(f"n{90000000 + k:08d}", f"synthetic class {k}") for k in range(len(_SYNSETS), classes)]
    return (_SYNSETS + made_up)[:classes]


def val_classes(classes: int, val_per_class: int, seed: int) -> list[int]:
    """The class of validation image ``i`` (1-based) at position ``i - 1``: each class
    ``val_per_class`` times, shuffled by ``seed``."""
    order = np.repeat(np.arange(classes), val_per_class)
    np.random.default_rng([seed, _ORDER]).shuffle(order)
    return [int(c) for c in order]


def class_colour(label: int, classes: int) -> np.ndarray:
    """The RGB colour (floats in [0, 1]) of class ``label``: hues evenly spaced around the wheel."""
    return np.array(colorsys.hsv_to_rgb(label / classes, 0.8, 0.95), dtype=np.float32)


def render(label: int, classes: int, size: tuple[int, int], rng: np.random.Generator
           ) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """One image of class ``label`` as ``uint8 (H, W, 3)`` and its object's box ``(x1, y1, x2, y2)``."""
    height, width = size
    colour = class_colour(label, classes)
    coarse = rng.random((4, 4, 3), dtype=np.float32)
    blotches = np.asarray(Image.fromarray((coarse * 255).astype(np.uint8), "RGB").resize(
        (width, height), Image.Resampling.BILINEAR), dtype=np.float32) / 255
    image = 0.7 * (0.25 + 0.5 * blotches) + 0.3 * colour  # a class tint: any crop shows something

    ry = height * rng.uniform(0.2, 0.4)
    rx = width * rng.uniform(0.2, 0.4)
    cy = rng.uniform(ry * 0.6, height - ry * 0.6)
    cx = rng.uniform(rx * 0.6, width - rx * 0.6)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    inside = ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1.0
    angle = math.pi * label / classes
    period = max(4.0, min(height, width) / 8)
    stripes = 0.5 + 0.5 * np.sin(2 * math.pi * (x * math.cos(angle) + y * math.sin(angle)) / period
                                 + rng.uniform(0, 2 * math.pi))
    shade = rng.uniform(0.8, 1.0)
    image[inside] = (colour * shade)[None, :] * (0.65 + 0.35 * stripes[inside])[:, None]
    image += rng.normal(0.0, 0.05, size=image.shape).astype(np.float32)
    pixels = (np.clip(image, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)
    box = (max(0, int(cx - rx)), max(0, int(cy - ry)), min(width - 1, int(math.ceil(cx + rx))),
           min(height - 1, int(math.ceil(cy + ry))))
    return pixels, box


def _jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "JPEG", quality=92)
    return buffer.getvalue()


def _write(path: str, data: bytes) -> None:
    with write_atomically(path, durable=False) as f:  # whole files only: a generated tree, not precious
        f.write(data)


def _check(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise InvalidArgumentError(f"phalanx.train.make_tiny_imagenet(): {name} must be {bound}, got {value!r}.")
    return value


def make_tiny_imagenet(root: str | os.PathLike[str], *, classes: int = 4, train_per_class: int = 16,
                       val_per_class: int = 8, size: int | Sequence[int] = (64, 64), seed: int = 0) -> str:
    """Write a tiny, learnable ImageNet tree of JPEGs (Kaggle layout) under ``root``; returns ``root``.

    Each class is a shape of its own colour on a noisy background, so a small
    network learns it in seconds; every file is the same for the same arguments.

    Arguments:
        root: a local directory (created if needed).
        classes: how many classes (1 to 1000), named by real ImageNet synsets.
        train_per_class, val_per_class: images per class in each split.
        size: ``(height, width)`` of every image, or an int for squares (each >= 16).
        seed: the random seed of the images and of the CSV order.

    Returns:
        ``root`` as a str. A tree already complete with the same arguments is left as it is.

    Raises:
        InvalidArgumentError: a bad argument, or ``root`` holds a tree made with other arguments
            (remove it or choose another ``root``).
    """
    call = "phalanx.train.make_tiny_imagenet()"
    root, (height, width) = _check_arguments(call, root, classes, train_per_class, val_per_class, size, seed)
    params = {"version": _VERSION, "classes": classes, "train_per_class": train_per_class,
              "val_per_class": val_per_class, "size": [height, width], "seed": seed}
    marker = os.path.join(root, MARKER)
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            try:
                found = json.load(f)
            except ValueError:
                found = None
        if found == params:
            return root
        raise InvalidArgumentError(
            f"{call}: {root!r} already holds a tiny ImageNet made with {found}, not {params}; remove the "
            "directory or pass another root.")
    classes_list = synsets(classes)
    _write(os.path.join(root, "LOC_synset_mapping.txt"),
           "".join(f"{s} {name}\n" for s, name in classes_list).encode())
    _write_train(root, classes_list, train_per_class, (height, width), seed)
    _write_val(root, classes_list, val_per_class, (height, width), seed)
    _write(marker, (json.dumps(params) + "\n").encode())  # last: the tree is complete
    return root


def _check_arguments(call: str, root: object, classes: int, train_per_class: int, val_per_class: int,
                     size: int | Sequence[int], seed: int) -> tuple[str, tuple[int, int]]:
    if not isinstance(root, (str, os.PathLike)):
        raise InvalidArgumentError(f"{call}: root must be a local directory path, got {root!r}.")
    root = os.fspath(root)
    if "://" in root:
        raise InvalidArgumentError(
            f"{call}: root must be a local directory, got the URL {root!r}; generate locally and copy it.")
    _check("classes", classes, 1, _MAX_CLASSES)
    _check("train_per_class", train_per_class, 1)
    _check("val_per_class", val_per_class, 1)
    _check("seed", seed, 0)
    pair: tuple[Any, ...] = ((size, size) if isinstance(size, int) and not isinstance(size, bool) else
                             tuple(size) if isinstance(size, Sequence) and not isinstance(size, str) else ())
    if len(pair) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 16 for s in pair):
        raise InvalidArgumentError(f"{call}: size must be an int or (height, width), each >= 16, got {size!r}.")
    return root, (int(pair[0]), int(pair[1]))


def _write_train(root: str, classes_list: list[tuple[str, str]], per_class: int, size: tuple[int, int],
                 seed: int) -> None:
    data = os.path.join(root, "ILSVRC", "Data", "CLS-LOC")
    rows = []
    for label, (synset, _) in enumerate(classes_list):
        folder = os.path.join(data, "train", synset)
        for i in range(1, per_class + 1):
            pixels, box = render(label, len(classes_list), size, np.random.default_rng([seed, _TRAIN, label, i]))
            image_id = f"{synset}_{i}"
            _write(os.path.join(folder, f"{image_id}.JPEG"), _jpeg(pixels))
            if i % 4 != 0:
                rows.append(f"{image_id},{synset} {' '.join(map(str, box))}\n")
    np.random.default_rng([seed, _ORDER, 1]).shuffle(rows)
    _write(os.path.join(root, "LOC_train_solution.csv"), ("ImageId,PredictionString\n" + "".join(rows)).encode())


def _write_val(root: str, classes_list: list[tuple[str, str]], per_class: int, size: tuple[int, int],
               seed: int) -> None:
    data = os.path.join(root, "ILSVRC", "Data", "CLS-LOC")
    rows = []
    for i, label in enumerate(val_classes(len(classes_list), per_class, seed), 1):
        pixels, box = render(label, len(classes_list), size, np.random.default_rng([seed, _VAL, i]))
        image_id = f"ILSVRC2012_val_{i:08d}"
        _write(os.path.join(data, "val", f"{image_id}.JPEG"), _jpeg(pixels))
        rows.append(f"{image_id},{classes_list[label][0]} {' '.join(map(str, box))}\n")
    _write(os.path.join(root, "LOC_val_solution.csv"), ("ImageId,PredictionString\n" + "".join(rows)).encode())


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m phalanx.train._tiny ROOT [--classes N] ...``: write the tree and print what it holds."""
    parser = argparse.ArgumentParser(prog="python -m phalanx.train._tiny",
                                     description="Write a tiny, learnable ImageNet tree (Kaggle layout) of JPEGs.")
    parser.add_argument("root", help="directory to write (created if needed)")
    parser.add_argument("--classes", type=int, default=4, help="number of classes (default 4)")
    parser.add_argument("--train-per-class", type=int, default=16, help="train images per class (default 16)")
    parser.add_argument("--val-per-class", type=int, default=8, help="validation images per class (default 8)")
    parser.add_argument("--size", type=int, nargs="+", default=[64, 64], metavar="N",
                        help="image size: N for squares or H W (default 64 64)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    size = args.size[0] if len(args.size) == 1 else tuple(args.size)
    try:
        root = make_tiny_imagenet(args.root, classes=args.classes, train_per_class=args.train_per_class,
                                  val_per_class=args.val_per_class, size=size, seed=args.seed)
    except InvalidArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{root}: {args.classes} classes, {args.classes * args.train_per_class} train and "
          f"{args.classes * args.val_per_class} validation images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
