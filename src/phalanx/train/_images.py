"""Image datasets: ImageNet in the Kaggle layout, and a folder per class.

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
the dataset yields (see :mod:`phalanx.train._transforms`).

The ImageNet layout these readers expect is spelled out in :class:`ImageNet`'s docstring.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

from .._errors import ImageReadError, InvalidArgumentError
from ._store import Store, listing
from ._transforms import pil_to_tensor

__all__ = ["ImageFolder", "ImageNet", "ImageReadError"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
IMAGENET_SPLITS = ("train", "val")
IMAGENET_INDEXES = ("folders", "csv")
_DATA = ("ILSVRC", "Data", "CLS-LOC")


def _shown(root: Any) -> Any:
    return os.fspath(root) if isinstance(root, os.PathLike) else root


class _ImageDataset(Dataset):
    """Shared behaviour: ``samples``, ``len``, ``__getitem__`` decoding with the optional transform."""

    samples: list[tuple[str, int]]
    classes: list[str]
    class_to_idx: dict[str, int]
    transform: Callable[[Image.Image], Any] | None
    _store: Store

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
        raise InvalidArgumentError(f"{call}: classes=[] keeps nothing; give at least one of {listing(known)}.")
    duplicates = sorted({c for c in wanted if wanted.count(c) > 1})
    if duplicates:
        raise InvalidArgumentError(f"{call}: classes lists {listing(duplicates)} more than once.")
    unknown = [c for c in wanted if c not in set(known)]
    if unknown:
        raise InvalidArgumentError(
            f"{call}: unknown {what} {listing(unknown)} in classes=; known: {listing(known)}.")
    keep = set(wanted)
    return [c for c in known if c in keep]


class ImageFolder(_ImageDataset):
    """Images in ``root/<class>/<file>`` (any depth below the class folder); labels in sorted class order.

    Hidden files and folders (names starting with ``.``) are skipped.

    Where the images are:
        root: a local directory or an fsspec URL (``s3://bucket/train``, ``gs://...``).
        storage_options: a dict of fsspec options for a URL (credentials,
            ``{"anon": True}``, ...); needs ``fsspec``.
    Which images:
        classes: keep the first N classes (sorted), or the listed class names
            (labels stay in sorted order); None keeps all.
        extensions: the file endings read (case-insensitive).
    What a sample is:
        transform: a callable applied to the RGB ``PIL.Image`` (e.g.
            :func:`phalanx.train.train_transform`); None gives a ``uint8`` tensor ``(3, H, W)``.

    Attributes: ``classes``, ``class_to_idx``, ``samples`` (``(path, label)``, sorted
    by label then path), ``targets``. Indexing returns ``(sample, label)``.

    Raises InvalidArgumentError (no such directory, no class folders, an empty
    class, a bad argument), MissingDependencyError (a URL without fsspec), and,
    when a sample is read, ImageReadError naming an image that cannot be decoded.
    """

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Image.Image], Any] | None = None, *,
                 classes: int | Sequence[str] | None = None,
                 extensions: Sequence[str] = IMAGE_EXTENSIONS,
                 storage_options: dict[str, Any] | None = None) -> None:
        call = f"phalanx.train.ImageFolder({_shown(root)!r})"
        store = Store(root, storage_options, call)
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
                f"{call}: no images ({', '.join(exts)}) in the class folder(s) {listing(empty)}; every class "
                "needs at least one (remove the folder, pass classes= without it, or pass extensions=).")

    def __repr__(self) -> str:
        return (f"ImageFolder({self.root!r}, classes={len(self.classes)}, samples={len(self.samples)}, "
                f"transform={self.transform!r})")


class ImageNet(_ImageDataset):
    """ImageNet (ILSVRC 2012 classification) in Kaggle's layout: ``(image, label)`` samples.

    The layout (Kaggle's ``imagenet-object-localization-challenge``)::

        LOC_synset_mapping.txt        "n01440764 tench, Tinca tinca": line order = class index
        LOC_train_solution.csv        ImageId,PredictionString ("n01440764 x1 y1 x2 y2 ...")
        LOC_val_solution.csv          ImageId,PredictionString
        ILSVRC/Data/CLS-LOC/train/<synset>/<ImageId>.JPEG
        ILSVRC/Data/CLS-LOC/val/<ImageId>.JPEG

    ``root``: a local directory or an fsspec URL (``s3://...``; ``storage_options``
    go to fsspec, which must be installed). ``transform``: applied to the RGB
    ``PIL.Image`` (without one a sample is a ``uint8`` tensor ``(3, H, W)``).
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

    Raises :class:`InvalidArgumentError` for a bad argument or a tree that is not in this layout,
    :class:`MissingDependencyError` for a URL without fsspec, and (when a sample is read)
    :class:`ImageReadError` naming an image that cannot be decoded.
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
        store = Store(root, storage_options, call)
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
                f"{call}: no {split} images for the {len(kept)} kept classes ({listing(kept)}) in "
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
                f"{call}: no images in {'/'.join(train)}/<synset>/ for {listing(missing)} in {store.root!r}; "
                "pass classes= to keep only the classes you have, or index='csv'.")
        return samples

    def __repr__(self) -> str:
        return (f"ImageNet({self.root!r}, {self.split!r}, classes={len(self.classes)}, "
                f"samples={len(self.samples)}, transform={self.transform!r})")


# transforms ---------------------------------------------------------------------------------------------
