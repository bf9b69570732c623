"""Writing files so that a reader never sees half of one.

::

    with write_atomically("runs/exp/curves.png") as f:   # binary by default
        f.write(data)

The data goes to a hidden temporary file beside the target
(``.<name>.tmp-<pid>``), is flushed and fsynced, optionally checked, and then
renamed over the target, and the directory is fsynced so the rename survives
a power cut. A crash or an exception at any moment leaves either the old file
or the new one, never a mixture, and no temporary file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import IO, Any

from ._errors import InvalidArgumentError

__all__ = ["fsync_directory", "temporary_name", "write_atomically"]


def temporary_name(target: str) -> str:
    """The hidden temporary file :func:`write_atomically` uses for ``target``."""
    directory, base = os.path.split(target)
    return os.path.join(directory, f".{base}.tmp-{os.getpid()}")


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems cannot fsync a directory)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def write_atomically(path: str | os.PathLike[str], mode: str = "wb", *, durable: bool = True,
                     check: Callable[[str], None] | None = None, **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temporary file for writing; on a clean exit, replace ``path`` with it.

    ``mode``: ``"wb"`` or ``"w"`` (text; ``open_kwargs`` such as ``encoding`` pass through).
    ``durable``: fsync the file and its directory (off for files that only need to be whole,
    not to survive a power cut). ``check(temp_path)``: called after the data is on disk and
    before the rename; an exception from it leaves ``path`` untouched. Parent directories are
    created. On any exception the temporary file is removed and the exception propagates.
    """
    if mode not in ("w", "wb"):
        raise InvalidArgumentError(f"phalanx._files.write_atomically(mode={mode!r}): use 'w' (text) or 'wb' (binary)")
    target = os.fspath(path)
    directory = os.path.dirname(target)
    if directory:
        os.makedirs(directory, exist_ok=True)
    temp = temporary_name(target)
    try:
        with open(temp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if check is not None:
            check(temp)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if durable:
        fsync_directory(directory)
