"""Where a dataset's files live: a local directory or an fsspec URL (``s3://``, ``gs://``, ``memory://``...).

Remote trees are listed with ``fsspec`` and each file is read whole with
``fs.open``; ``storage_options`` go to the filesystem (credentials,
``anon=True``, ...). The store pickles without its filesystem object, which
each process makes on first use (DataLoader workers included).
"""

from __future__ import annotations

import io
import os
import posixpath
from collections.abc import Sequence
from typing import Any

from PIL import Image

from .._errors import InvalidArgumentError, MissingDependencyError

__all__ = ["Store", "is_url", "listing"]

_SHOWN = 8  # names listed in an error message

def is_url(path: str) -> bool:
    """Whether ``path`` is an fsspec URL (``proto://...`` or a chained ``a::b://...``) rather than a local path."""
    return "://" in path or "::" in path


def _shown(root: Any) -> Any:
    return os.fspath(root) if isinstance(root, os.PathLike) else root


def listing(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")



class Store:
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
                raise MissingDependencyError(
                    f"{self.call}: root={self.root!r} is a URL, which needs fsspec: pip install fsspec "
                    "(plus s3fs for s3://, gcsfs for gs://), or pip install 'phalanx[train]'.") from exc
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
