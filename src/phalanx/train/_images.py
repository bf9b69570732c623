"""Image datasets (ImageNet in the Kaggle layout, a folder per class) and their transforms.

::

    from phalanx.train import ImageNet, ImageFolder, train_transform, eval_transform

    train = ImageNet("/data/imagenet", "train", train_transform(224))
    val = ImageNet("s3://bucket/imagenet", "val", eval_transform(224), classes=100,
                   storage_options={"anon": True})
    flowers = ImageFolder("/data/flowers/train", eval_transform(160))
    image, label = train[0]            # a float tensor (3, 224, 224) and an int
    loader = DataLoader(train, batch_size=256, num_workers=8,
                        multiprocessing_context=phalanx.torch.dataloader_context(8))

The index of samples (``.samples``: ``(path, label)`` pairs) is built once,
in the constructor, sorted, so it is the same in every process and on every
rank. Images are read and decoded (Pillow, converted to RGB) in
``__getitem__``, i.e. in the DataLoader's worker processes when
``num_workers > 0``. A dataset holds only strings, lists and its transform,
so it pickles for workers started with ``spawn`` or ``forkserver``.

``root`` is a local directory or an fsspec URL (``s3://bucket/imagenet``,
``gs://...``, ``file:///...``, ``memory://...``): remote trees are listed with
``fsspec`` and each image is read whole with ``fs.open``; ``storage_options``
go to the filesystem (credentials, ``anon=True``, ...). Each process makes
its own filesystem object on first use.

Without a ``transform`` an image comes back as a ``uint8`` tensor
``(3, H, W)``; a transform receives the ``PIL.Image`` (RGB) and returns what
the dataset yields. :func:`train_transform` (random resized crop, random
horizontal flip, normalise) and :func:`eval_transform` (resize the short side,
centre crop, normalise) are the usual ImageNet recipes; they draw their random
numbers from ``torch``, so ``torch.manual_seed`` and DataLoader worker seeding
make them reproducible.

ImageNet layout (Kaggle's ``imagenet-object-localization-challenge``)::

    LOC_synset_mapping.txt           "n01440764 tench, Tinca tinca": line order = class index
    LOC_train_solution.csv           ImageId,PredictionString ("n01440764 x1 y1 x2 y2 ...")
    LOC_val_solution.csv             ImageId,PredictionString
    ILSVRC/Data/CLS-LOC/train/<synset>/<ImageId>.JPEG
    ILSVRC/Data/CLS-LOC/val/<ImageId>.JPEG
"""

from __future__ import annotations

import csv
import io
import math
import os
import posixpath
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from .._errors import ImageReadError, InvalidArgumentError

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "EvalTransform",
    "ImageFolder",
    "ImageNet",
    "ImageReadError",
    "TrainTransform",
    "eval_transform",
    "train_transform",
]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
IMAGENET_SPLITS = ("train", "val")
IMAGENET_INDEXES = ("folders", "csv")
_DATA = ("ILSVRC", "Data", "CLS-LOC")
_SHOWN = 8  # names listed in an error message


def is_url(path: str) -> bool:
    """Whether ``path`` is an fsspec URL (``proto://...`` or a chained ``a::b://...``) rather than a local path."""
    return "://" in path or "::" in path


def _shown(root: Any) -> Any:
    return os.fspath(root) if isinstance(root, os.PathLike) else root


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


class _Store:
    """Where a dataset's files live: a local directory or an fsspec URL.

    Picklable: the fsspec filesystem is made on first use in each process and
    never pickled. Paths handed out (``.samples``) are local paths or full URLs.
    """

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None,
                 call: str) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"{call}: root must be a directory path or an fsspec URL (a str), got {type(root).__name__} "
                f"{root!r}.")
        text = os.fspath(root)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise InvalidArgumentError(
                f"{call}: storage_options must be a dict of fsspec options (e.g. {{'anon': True}}), got "
                f"{type(storage_options).__name__} {storage_options!r}.")
        self.call = call
        self.url = is_url(text)
        if self.url:
            stripped = text.rstrip("/")
            self.root = text if stripped.endswith(":") else stripped
        else:
            if storage_options:
                raise InvalidArgumentError(
                    f"{call}: storage_options={storage_options!r} are for fsspec URLs, but root={text!r} is "
                    "a local path; drop them or give a URL (s3://..., file:///...).")
            self.root = os.path.abspath(os.path.expanduser(text))
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._base = ""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"] = None
        return state

    def _filesystem(self) -> Any:
        if self._fs is None:
            try:
                from fsspec.core import url_to_fs
            except ImportError as exc:
                raise InvalidArgumentError(
                    f"{self.call}: root={self.root!r} is a URL, which needs fsspec: pip install fsspec "
                    "(plus s3fs for s3://, gcsfs for gs://).") from exc
            try:
                self._fs, self._base = url_to_fs(self.root, **self.storage_options)
            except (ImportError, ValueError) as exc:
                raise InvalidArgumentError(f"{self.call}: cannot open {self.root!r} with fsspec: {exc}") from exc
            self._base = self._base.rstrip("/")
        return self._fs

    # paths ------------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """The public path (local path or URL) of ``root/parts...``."""
        if not self.url:
            return os.path.join(self.root, *parts)
        rel = "/".join(parts)
        return self.root + rel if self.root.endswith("/") else f"{self.root}/{rel}"

    def _fs_path(self, *parts: str) -> str:
        self._filesystem()
        rel = "/".join(p for p in parts if p)
        if not rel:
            return self._base
        return f"{self._base}/{rel}" if self._base else rel

    def _relative(self, fs_path: str, base: str) -> str:
        if base and fs_path.startswith(base):
            return fs_path[len(base):].lstrip("/")
        return posixpath.relpath(fs_path, base or "/")

    # queries ----------------------------------------------------------------------------------------
    def isdir(self, *parts: str) -> bool:
        if not self.url:
            return os.path.isdir(self.path(*parts))
        return bool(self._filesystem().isdir(self._fs_path(*parts)))

    def isfile(self, *parts: str) -> bool:
        if not self.url:
            return os.path.isfile(self.path(*parts))
        return bool(self._filesystem().isfile(self._fs_path(*parts)))

    def subdirs(self, *parts: str) -> list[str]:
        """Sorted names of the directories directly under ``root/parts``."""
        if not self.url:
            with os.scandir(self.path(*parts)) as it:
                return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))
        fs, where = self._filesystem(), self._fs_path(*parts)
        names = [posixpath.basename(str(e["name"]).rstrip("/")) for e in fs.ls(where, detail=True)
                 if e.get("type") == "directory"]
        return sorted(n for n in names if n and not n.startswith("."))

    def files(self, extensions: tuple[str, ...], *parts: str) -> list[str]:
        """Sorted ``/``-separated paths, relative to ``root/parts``, of the files below it whose names end with
        one of ``extensions`` (lower case; the comparison ignores case). Hidden files and folders (``.name``,
        e.g. macOS's ``._photo.jpg``) are skipped."""
        found: list[str] = []
        if not self.url:
            top = self.path(*parts)
            for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                rel = os.path.relpath(dirpath, top)
                for name in filenames:
                    if name.lower().endswith(extensions) and not name.startswith("."):
                        found.append(name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}")
        else:
            fs, where = self._filesystem(), self._fs_path(*parts)
            for path in fs.find(where):
                rel = self._relative(path, where)
                if rel.lower().endswith(extensions) and not any(p.startswith(".") for p in rel.split("/")):
                    found.append(rel)
        return sorted(found)

    def read_text(self, *parts: str) -> str:
        if not self.url:
            with open(self.path(*parts), encoding="utf-8") as f:
                return f.read()
        with self._filesystem().open(self._fs_path(*parts), "rb") as f:
            return f.read().decode("utf-8")

    def load_image(self, path: str) -> Image.Image:
        """Read and decode the image at the public ``path``, as RGB."""
        if not self.url:
            with open(path, "rb") as f:
                image = Image.open(f)
                return image.convert("RGB")
        rel = path[len(self.root):].lstrip("/")
        with self._filesystem().open(self._fs_path(rel), "rb") as f:
            data = f.read()
        return Image.open(io.BytesIO(data)).convert("RGB")


class _ImageDataset(Dataset):
    """Shared behaviour: ``samples``, ``len``, ``__getitem__`` decoding with the optional transform."""

    samples: list[tuple[str, int]]
    classes: list[str]
    class_to_idx: dict[str, int]
    transform: Callable[[Image.Image], Any] | None
    _store: _Store

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.samples[index]
        try:
            image = self._store.load_image(path)
        except (OSError, Image.DecompressionBombError) as exc:
            raise ImageReadError(
                f"phalanx.train.{type(self).__name__}: cannot read image {path!r} (sample {index}, label "
                f"{label}): {type(exc).__name__}: {exc}") from exc
        if self.transform is None:
            return pil_to_tensor(image), label
        return self.transform(image), label

    @property
    def root(self) -> str:
        """The dataset's root directory or URL."""
        return self._store.root

    @property
    def targets(self) -> list[int]:
        """The label of every sample, in sample order."""
        return [label for _, label in self.samples]


def _check_transform(call: str, transform: Any) -> None:
    if transform is not None and not callable(transform):
        raise InvalidArgumentError(
            f"{call}: transform must be a callable taking a PIL image (e.g. phalanx.train.train_transform()) "
            f"or None, got {type(transform).__name__} {transform!r}.")


def _extensions(call: str, extensions: Iterable[str]) -> tuple[str, ...]:
    if isinstance(extensions, str):
        extensions = (extensions,)
    exts = tuple(str(e).lower() for e in extensions)
    if not exts or not all(e.startswith(".") and len(e) > 1 for e in exts):
        raise InvalidArgumentError(
            f"{call}: extensions must be file name endings such as ('.jpg', '.png'), got {extensions!r}.")
    return exts


def _select(call: str, known: list[str], classes: int | Sequence[str] | None, what: str) -> list[str]:
    """The kept classes, in ``known`` order: all, the first ``classes``, or those listed."""
    if classes is None:
        return list(known)
    if isinstance(classes, bool) or not isinstance(classes, (int, list, tuple)):
        raise InvalidArgumentError(
            f"{call}: classes must be None, a number of classes or a list of {what}, got "
            f"{type(classes).__name__} {classes!r}.")
    if isinstance(classes, int):
        if not 1 <= classes <= len(known):
            raise InvalidArgumentError(
                f"{call}: classes={classes} is out of range: there are {len(known)} classes, keep 1 to "
                f"{len(known)} of them.")
        return list(known[:classes])
    wanted = [str(c) for c in classes]
    if not wanted:
        raise InvalidArgumentError(f"{call}: classes=[] keeps nothing; give at least one of {_listing(known)}.")
    duplicates = sorted({c for c in wanted if wanted.count(c) > 1})
    if duplicates:
        raise InvalidArgumentError(f"{call}: classes lists {_listing(duplicates)} more than once.")
    unknown = [c for c in wanted if c not in set(known)]
    if unknown:
        raise InvalidArgumentError(
            f"{call}: unknown {what} {_listing(unknown)} in classes=; known: {_listing(known)}.")
    keep = set(wanted)
    return [c for c in known if c in keep]


class ImageFolder(_ImageDataset):
    """Images in ``root/<class>/<file>`` (any depth below the class folder); labels in sorted class order.
    Hidden files and folders (names starting with ``.``) are skipped.

    ``classes``: keep the first N classes (sorted), or the listed class names
    (labels stay in sorted order). ``extensions``: the file endings read
    (case-insensitive). Attributes: ``classes``, ``class_to_idx``, ``samples``
    (``(path, label)``, sorted by label then path), ``targets``.
    """

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Image.Image], Any] | None = None, *,
                 classes: int | Sequence[str] | None = None,
                 extensions: Sequence[str] = IMAGE_EXTENSIONS,
                 storage_options: dict[str, Any] | None = None) -> None:
        call = f"phalanx.train.ImageFolder({_shown(root)!r})"
        store = _Store(root, storage_options, call)
        _check_transform(call, transform)
        exts = _extensions(call, extensions)
        if not store.isdir():
            raise InvalidArgumentError(f"{call}: {store.root!r} is not a directory.")
        found = store.subdirs()
        if not found:
            raise InvalidArgumentError(
                f"{call}: no class folders in {store.root!r}; expected root/<class>/<image> (e.g. "
                "root/cat/1.jpg, root/dog/2.jpg).")
        kept = _select(call, found, classes, "class names")
        self._store = store
        self.transform = transform
        self.extensions = exts
        self.classes = kept
        self.class_to_idx = {c: i for i, c in enumerate(kept)}
        self.samples = []
        empty = []
        for label, name in enumerate(kept):
            files = store.files(exts, name)
            if not files:
                empty.append(name)
            self.samples.extend((store.path(name, *f.split("/")), label) for f in files)
        if empty:
            raise InvalidArgumentError(
                f"{call}: no images ({', '.join(exts)}) in the class folder(s) {_listing(empty)}; every class "
                "needs at least one (remove the folder, pass classes= without it, or pass extensions=).")

    def __repr__(self) -> str:
        return (f"ImageFolder({self.root!r}, classes={len(self.classes)}, samples={len(self.samples)}, "
                f"transform={self.transform!r})")


class ImageNet(_ImageDataset):
    """ImageNet (ILSVRC 2012 classification) in Kaggle's layout (module docstring).

    ``split``: ``"train"`` or ``"val"``. ``classes``: keep the first N synsets
    of ``LOC_synset_mapping.txt``, or the listed synset ids, labelled in
    mapping order. ``index`` (train only): ``"folders"`` lists every image in
    ``ILSVRC/Data/CLS-LOC/train/<synset>/`` (label from the folder, as
    torchvision does); ``"csv"`` takes the images named in
    ``LOC_train_solution.csv`` (only those with bounding boxes, 544,546 of
    1,281,167 in the real data). Validation labels are the first synset of
    ``PredictionString`` in ``LOC_val_solution.csv``.

    Attributes: ``classes`` (synset ids), ``names`` (their descriptions),
    ``class_to_idx``, ``samples`` (sorted by label then path for train, by
    ``ImageId`` for val), ``targets``.
    """

    def __init__(self, root: str | os.PathLike[str], split: str = "train",
                 transform: Callable[[Image.Image], Any] | None = None, *,
                 classes: int | Sequence[str] | None = None, index: str = "folders",
                 storage_options: dict[str, Any] | None = None) -> None:
        call = f"phalanx.train.ImageNet({_shown(root)!r}, {split!r})"
        if split not in IMAGENET_SPLITS:
            raise InvalidArgumentError(f"{call}: split must be 'train' or 'val', got {split!r}.")
        if index not in IMAGENET_INDEXES:
            raise InvalidArgumentError(
                f"{call}: index must be 'folders' (every image in the train folders) or 'csv' (the images "
                f"in LOC_train_solution.csv), got {index!r}.")
        store = _Store(root, storage_options, call)
        _check_transform(call, transform)
        self._store = store
        self.split = split
        self.index = index
        self.transform = transform

        mapping = self._read_mapping(call)
        kept = _select(call, list(mapping), classes, "synset ids")
        self.classes = kept
        self.names = [mapping[s] for s in kept]
        self.class_to_idx = {s: i for i, s in enumerate(kept)}
        if split == "val":
            self.samples = self._from_csv(call, "LOC_val_solution.csv", mapping, val=True)
        elif index == "csv":
            self.samples = self._from_csv(call, "LOC_train_solution.csv", mapping, val=False)
        else:
            self.samples = self._from_folders(call)
        if not self.samples:
            raise InvalidArgumentError(
                f"{call}: no {split} images for the {len(kept)} kept classes ({_listing(kept)}) in "
                f"{store.root!r}.")

    def _read_mapping(self, call: str) -> dict[str, str]:
        store = self._store
        if not store.isfile("LOC_synset_mapping.txt"):
            raise InvalidArgumentError(
                f"{call}: no LOC_synset_mapping.txt in {store.root!r}. Expected Kaggle's ImageNet layout: "
                "LOC_synset_mapping.txt, LOC_train_solution.csv, LOC_val_solution.csv and "
                "ILSVRC/Data/CLS-LOC/{train/<synset>,val}/<ImageId>.JPEG (for a folder per class use "
                "phalanx.train.ImageFolder).")
        mapping: dict[str, str] = {}
        for number, line in enumerate(store.read_text("LOC_synset_mapping.txt").splitlines(), 1):
            if not line.strip():
                continue
            synset, _, name = line.strip().partition(" ")
            if synset in mapping:
                raise InvalidArgumentError(
                    f"{call}: LOC_synset_mapping.txt line {number} repeats synset {synset!r}.")
            mapping[synset] = name.strip()
        if not mapping:
            raise InvalidArgumentError(f"{call}: LOC_synset_mapping.txt in {store.root!r} is empty.")
        return mapping

    def _from_csv(self, call: str, filename: str, mapping: dict[str, str], *, val: bool) -> list[tuple[str, int]]:
        store = self._store
        if not store.isfile(filename):
            raise InvalidArgumentError(
                f"{call}: no {filename} in {store.root!r}"
                + ("." if val else "; use index='folders' to list the train folders instead."))
        reader = csv.reader(io.StringIO(store.read_text(filename)))
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["ImageId", "PredictionString"]:
            raise InvalidArgumentError(
                f"{call}: {filename} must start with the header 'ImageId,PredictionString', got {header!r}.")
        rows: list[tuple[str, int]] = []
        for number, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) < 2 or not row[0].strip() or not row[1].split():
                raise InvalidArgumentError(
                    f"{call}: {filename} line {number}: expected 'ImageId,<synset> x1 y1 x2 y2 ...', got "
                    f"{','.join(row)!r}.")
            image_id, synset = row[0].strip(), row[1].split()[0]
            if synset not in mapping:
                raise InvalidArgumentError(
                    f"{call}: {filename} line {number}: synset {synset!r} is not in LOC_synset_mapping.txt.")
            label = self.class_to_idx.get(synset)
            if label is None:
                continue
            parts = (*_DATA, "val", f"{image_id}.JPEG") if val else \
                (*_DATA, "train", image_id.split("_")[0], f"{image_id}.JPEG")
            rows.append((store.path(*parts), label))
        rows.sort(key=(lambda s: s[0]) if val else (lambda s: (s[1], s[0])))
        return rows

    def _from_folders(self, call: str) -> list[tuple[str, int]]:
        store = self._store
        train = (*_DATA, "train")
        if not store.isdir(*train):
            raise InvalidArgumentError(f"{call}: no folder {'/'.join(train)} in {store.root!r}.")
        samples: list[tuple[str, int]] = []
        missing = []
        if store.url and len(self.classes) > 1 and len(self.classes) == len(store.subdirs(*train)):
            # one recursive listing instead of one per class (fewer round trips to object stores)
            grouped: dict[str, list[str]] = {}
            for rel in store.files(IMAGE_EXTENSIONS, *train):
                folder, _, name = rel.partition("/")
                grouped.setdefault(folder, []).append(name)
            for label, synset in enumerate(self.classes):
                names = grouped.get(synset, [])
                missing += [] if names else [synset]
                samples.extend((store.path(*train, synset, *n.split("/")), label) for n in names)
        else:
            for label, synset in enumerate(self.classes):
                if not store.isdir(*train, synset):
                    missing.append(synset)
                    continue
                names = store.files(IMAGE_EXTENSIONS, *train, synset)
                missing += [] if names else [synset]
                samples.extend((store.path(*train, synset, *n.split("/")), label) for n in names)
        if missing:
            raise InvalidArgumentError(
                f"{call}: no images in {'/'.join(train)}/<synset>/ for {_listing(missing)} in {store.root!r}; "
                "pass classes= to keep only the classes you have, or index='csv'.")
        return samples

    def __repr__(self) -> str:
        return (f"ImageNet({self.root!r}, {self.split!r}, classes={len(self.classes)}, "
                f"samples={len(self.samples)}, transform={self.transform!r})")


# transforms ---------------------------------------------------------------------------------------------

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
    return triple  # type: ignore[return-value]


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
    ``mean``/``std`` (see :class:`TrainTransform`)."""
    return TrainTransform(size, scale=scale, ratio=ratio, flip=flip, mean=mean, std=std)


def eval_transform(size: int | Sequence[int] = 224, *, resize: int | None = None,
                   mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> EvalTransform:
    """The evaluation transform: resize the short side to ``resize`` (default ``round(size * 256 / 224)``:
    256 for 224; the larger side of a ``(height, width)`` size), centre crop ``size``, float tensor
    ``(3, H, W)`` normalised (see :class:`EvalTransform`)."""
    return EvalTransform(size, resize=resize, mean=mean, std=std)
