"""A registry of datasets by name, read from a TOML file.

::

    # datasets.toml
    [datasets.tiny-imagenet]
    format = "imagenet"              # Kaggle's ImageNet layout (phalanx.train.ImageNet)
    path = "data/tiny-imagenet"      # relative to this file, absolute, ~/..., $VAR/..., or an fsspec URL
    classes = 4                      # optional: the first N synsets, or a list of synset ids

    [datasets.flowers]
    format = "imagefolder"           # root/<split>/<class>/<image> (phalanx.train.ImageFolder)
    path = "s3://bucket/flowers"
    train = "train"                  # the folder of each split (default "train" and "val")
    val = "validation"
    storage_options = { anon = true }   # passed to fsspec

    registry = phalanx.train.load_registry()      # $PHALANX_DATASETS, else ./datasets.toml
    train = registry.open("tiny-imagenet", "train", phalanx.train.train_transform(56))
    val = registry.open("tiny-imagenet", "val", phalanx.train.eval_transform(56))

Keys of an entry: ``format`` and ``path`` (required), ``storage_options``
and ``description`` (any format), ``classes`` and ``index`` (``"folders"``
or ``"csv"``, see :class:`~phalanx.train.ImageNet`) for ``imagenet``,
``classes``, ``train``, ``val`` and ``extensions`` for ``imagefolder``.
Anything else is an error, so a misspelt key is not silently ignored. The
file is checked when loaded; the data only when a dataset is opened.
"""

from __future__ import annotations

import copy
import difflib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import Dataset

from .._errors import InvalidArgumentError
from ._images import IMAGENET_INDEXES, IMAGENET_SPLITS, ImageFolder, ImageNet
from ._store import is_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["DatasetRegistry", "load_registry"]

ENV = "PHALANX_DATASETS"
DEFAULT_FILE = "datasets.toml"
_COMMON = ("format", "path", "storage_options", "description")
KEYS: dict[str, tuple[str, ...]] = {
    "imagenet": _COMMON + ("classes", "index"),
    "imagefolder": _COMMON + ("classes", "train", "val", "extensions"),
}
FORMATS = tuple(KEYS)


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_entry(where: str, name: Any, entry: Any) -> dict[str, Any]:
    """A validated copy of one entry; ``where`` names the file for messages."""
    at = f"{where}: [datasets.{name}]"
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{where}: dataset names must be non-empty strings, got {name!r}.")
    if not isinstance(entry, Mapping):
        raise InvalidArgumentError(
            f"{at} must be a table with format = ... and path = ..., got {type(entry).__name__} {entry!r}.")
    entry = dict(entry)
    for key in ("format", "path"):
        if key not in entry:
            example = 'format = "imagenet"' if key == "format" else 'path = "data/imagenet"'
            raise InvalidArgumentError(f"{at} has no {key!r}; add e.g. {example}.")
    fmt = entry["format"]
    if fmt not in KEYS:
        raise InvalidArgumentError(
            f"{at}: unknown format {fmt!r}{_suggest(str(fmt), FORMATS)}; known formats: "
            f"{', '.join(repr(f) for f in FORMATS)}.")
    unknown = [key for key in entry if key not in KEYS[fmt]]
    if unknown:
        key = unknown[0]
        raise InvalidArgumentError(
            f"{at}: unknown key {key!r}{_suggest(key, KEYS[fmt])}; a {fmt!r} entry takes "
            f"{', '.join(KEYS[fmt])}.")
    if not isinstance(entry["path"], str) or not entry["path"].strip():
        raise InvalidArgumentError(f"{at}: path must be a non-empty string, got {entry['path']!r}.")
    options = entry.get("storage_options", {})
    if not isinstance(options, Mapping):
        raise InvalidArgumentError(
            f"{at}: storage_options must be a table, e.g. storage_options = {{ anon = true }}, got {options!r}.")
    if options and not is_url(entry["path"]):
        raise InvalidArgumentError(
            f"{at}: storage_options are for fsspec URLs (s3://..., gs://...), but path {entry['path']!r} is "
            "local; remove them.")
    if "description" in entry and not isinstance(entry["description"], str):
        raise InvalidArgumentError(f"{at}: description must be a string, got {entry['description']!r}.")
    if "classes" in entry:
        classes = entry["classes"]
        ok = (isinstance(classes, int) and not isinstance(classes, bool) and classes >= 1) or (
            isinstance(classes, list) and classes and all(isinstance(c, str) and c for c in classes))
        if not ok:
            raise InvalidArgumentError(
                f"{at}: classes must be a number of classes (>= 1) or a list of class names "
                f'(e.g. ["n01440764", "n01443537"]), got {classes!r}.')
    if "index" in entry and entry["index"] not in IMAGENET_INDEXES:
        raise InvalidArgumentError(
            f"{at}: index must be 'folders' or 'csv'{_suggest(str(entry['index']), IMAGENET_INDEXES)}, got "
            f"{entry['index']!r}.")
    for split in ("train", "val"):
        if split in entry and (not isinstance(entry[split], str) or not entry[split].strip("/")):
            raise InvalidArgumentError(
                f"{at}: {split} must be the {split} folder under path (a string), got {entry[split]!r}.")
    if "extensions" in entry:
        exts = entry["extensions"]
        if not isinstance(exts, list) or not exts or not all(isinstance(e, str) and e.startswith(".")
                                                             for e in exts):
            raise InvalidArgumentError(
                f'{at}: extensions must be a list of file endings such as [".jpg", ".png"], got {exts!r}.')
    return copy.deepcopy(entry)


def _resolve(path: str, base_dir: str) -> str:
    if is_url(path):
        return path
    path = os.path.expanduser(os.path.expandvars(path))
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(base_dir, path))


class DatasetRegistry:
    """Named datasets: ``names()``, ``entry(name)``, ``open(name, split, transform)``; ``name in registry``.

    Usually made by :func:`load_registry`; ``DatasetRegistry({"name": {"format": ..., "path": ...}},
    base_dir=...)`` builds one from a mapping.

    Arguments:
        datasets: a mapping of dataset names to entries (``{"format": ..., "path": ...}``
            and the format's options).
        base_dir: the directory relative paths resolve against (None: the current directory).
        source: where the entries came from (e.g. the registry file's path), named in
            error messages; None names the constructor.

    Raises InvalidArgumentError for a malformed entry, naming it and ``source``.
    """

    def __init__(self, datasets: Mapping[str, Mapping[str, Any]], *, base_dir: str | os.PathLike[str] | None = None,
                 source: str | None = None) -> None:
        self.source = source
        where = source or "phalanx.train.DatasetRegistry()"
        if not isinstance(datasets, Mapping):
            raise InvalidArgumentError(
                f"{where}: datasets must be a mapping of names to entries, got {type(datasets).__name__}.")
        self.base_dir = os.path.abspath(os.fspath(base_dir) if base_dir is not None else os.getcwd())
        self._entries: dict[str, dict[str, Any]] = {}
        for name, entry in datasets.items():
            checked = _check_entry(where, name, entry)
            checked["path"] = _resolve(checked["path"], self.base_dir)
            self._entries[name] = checked

    def names(self) -> list[str]:
        """The dataset names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def _get(self, call: str, name: str) -> dict[str, Any]:
        if name not in self._entries:
            known = ", ".join(repr(n) for n in self.names()) or "none"
            hint = _suggest(str(name), self.names())
            raise InvalidArgumentError(
                f"{call}: no dataset {name!r}{hint} in {self.source or 'this registry'}; known: {known}.")
        return self._entries[name]

    def entry(self, name: str) -> dict[str, Any]:
        """A copy of the entry ``name``, its ``path`` resolved (absolute local path, or the URL)."""
        return copy.deepcopy(self._get(f"phalanx.train.DatasetRegistry.entry({name!r})", name))

    def open(self, name: str, split: str = "train", transform: Callable[[Any], Any] | None = None,
             **overrides: Any) -> Dataset:
        """The dataset ``name``'s ``split`` (``"train"`` or ``"val"``) as a torch ``Dataset`` yielding
        ``(transform(image), label)``.

        ``overrides`` replace keys of the entry for this call (e.g. ``classes=10``).
        """
        call = f"phalanx.train.DatasetRegistry.open({name!r}, {split!r})"
        entry = dict(self._get(call, name))
        if overrides:
            entry = _check_entry(call, name, {**entry, **overrides})
            entry["path"] = _resolve(entry["path"], self.base_dir)
        if split not in IMAGENET_SPLITS:
            raise InvalidArgumentError(f"{call}: split must be 'train' or 'val', got {split!r}.")
        options = dict(entry.get("storage_options", {})) or None
        if entry["format"] == "imagenet":
            return ImageNet(entry["path"], split, transform, classes=entry.get("classes"),
                            index=entry.get("index", "folders"), storage_options=options)
        folder = entry.get(split, split).strip("/")
        path = entry["path"]
        root = f"{path.rstrip('/')}/{folder}" if is_url(path) else os.path.join(path, *folder.split("/"))
        extra = {"extensions": tuple(entry["extensions"])} if "extensions" in entry else {}
        return ImageFolder(root, transform, classes=entry.get("classes"), storage_options=options, **extra)

    def __repr__(self) -> str:
        where = f"{self.source!r}, " if self.source else ""
        return f"DatasetRegistry({where}datasets={self.names()})"


def load_registry(path: str | os.PathLike[str] | None = None) -> DatasetRegistry:
    """Read a TOML registry of named datasets and return it as a :class:`DatasetRegistry`.

    ::

        # datasets.toml
        [datasets.tiny-imagenet]
        format = "imagenet"            # or "imagefolder" (root/<split>/<class>/<image>)
        path = "data/tiny-imagenet"    # relative to this file, absolute, ~/..., $VAR/..., or an fsspec URL
        classes = 4                    # optional

        train = load_registry().open("tiny-imagenet", "train", train_transform(56))

    Keys of an entry: ``format`` and ``path`` (required), ``storage_options`` and
    ``description``; ``classes`` and ``index`` for ``imagenet``; ``classes``,
    ``train``, ``val`` and ``extensions`` for ``imagefolder``. Other keys are errors.

    Arguments:
        path: the TOML file; ``None``: ``$PHALANX_DATASETS`` if set, else ``./datasets.toml``.
            Relative dataset paths resolve against the file's directory.

    Raises:
        InvalidArgumentError: no such file, invalid TOML, or an entry with a missing, unknown or
            misspelt key (the message names the file and the key).
    """
    if path is None:
        env = os.environ.get(ENV)
        path, origin = (env, f"${ENV}") if env else (DEFAULT_FILE, "the default, as $PHALANX_DATASETS is not set")
    else:
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"phalanx.train.load_registry(): path must be a file path, got {type(path).__name__} {path!r}.")
        origin = "the path given"
    text_path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    call = f"phalanx.train.load_registry({os.fspath(path)!r})"
    if not os.path.isfile(text_path):
        raise InvalidArgumentError(
            f"{call}: no dataset registry at {text_path} ({origin}). Write one (see examples/datasets.toml), "
            f"pass its path, or set ${ENV} to it.")
    try:
        with open(text_path, "rb") as f:
            document = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgumentError(f"{call}: {text_path} is not valid TOML: {exc}.") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"{call}: cannot read {text_path}: {exc}.") from exc
    unknown = [key for key in document if key != "datasets"]
    if unknown:
        raise InvalidArgumentError(
            f"{call}: {text_path}: unknown top-level key {unknown[0]!r}{_suggest(unknown[0], ['datasets'])}; "
            "entries go in [datasets.<name>] tables.")
    if "datasets" not in document:
        raise InvalidArgumentError(
            f"{call}: {text_path} has no [datasets.<name>] tables; add e.g.\n"
            '[datasets.tiny-imagenet]\nformat = "imagenet"\npath = "data/tiny-imagenet"')
    if not isinstance(document["datasets"], dict):
        raise InvalidArgumentError(f"{call}: {text_path}: 'datasets' must be a table of [datasets.<name>] tables.")
    return DatasetRegistry(document["datasets"], base_dir=os.path.dirname(text_path), source=text_path)
