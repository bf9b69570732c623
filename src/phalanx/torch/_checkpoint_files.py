"""A checkpoint directory replaced as a whole: written beside its target, renamed into place, nothing left over.

::

    clear_leftovers(target)            # what a killed save left: <target>.tmp-*, <target>.old-*
    temp = staging(target, token)      # <target>.tmp-<token>, written into
    commit(temp, target, token)        # from here <target> is the new directory; the previous one is gone
    discard(temp)                      # or, on a failure, instead

``commit`` moves the previous directory aside to ``<target>.old-<token>``,
renames the new one into place and removes the previous one; a failure of
the second rename puts the previous one back. A save that is killed leaves
``<target>.tmp-<token>``, and one killed between the two renames also
``<target>.old-<token>`` with no ``<target>``: :func:`clear_leftovers`, which
the next save to that target calls before it starts, removes the first and
renames the second back to ``<target>`` (the previous checkpoint, which the
new save then replaces as usual). Only names of exactly that pattern (12
lowercase hex digits) are touched.
"""

from __future__ import annotations

import os
import re
import shutil

from .._files import fsync_directory

__all__ = ["clear_leftovers", "commit", "discard", "staging"]


def staging(target: str, token: str) -> str:
    """The temporary directory a save of ``target`` writes into."""
    return f"{target}.tmp-{token}"


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def discard(temp: str) -> None:
    """Remove a save's temporary directory (or what is left of it); never raises."""
    _remove(temp)


def clear_leftovers(target: str) -> list[str]:
    """Remove what killed saves of ``target`` left beside it; return the names removed or restored.

    ``<target>.tmp-<token>``: removed. ``<target>.old-<token>``: removed when ``target`` exists (a
    save that was killed after its commit), else the newest is renamed back to ``target`` (killed
    mid-commit: it is the previous checkpoint) and any others are removed.
    """
    parent, base = os.path.split(target)
    pattern = re.compile(rf"{re.escape(base)}\.(tmp|old)-[0-9a-f]{{12}}")
    try:
        names = sorted(os.listdir(parent or "."))
    except FileNotFoundError:
        return []
    found = [(m.group(1), os.path.join(parent, n)) for n in names if (m := pattern.fullmatch(n))]
    olds = sorted((p for kind, p in found if kind == "old"), key=os.path.getmtime)
    if olds and not os.path.lexists(target):
        os.replace(olds.pop(), target)
        fsync_directory(parent)
    for kind, path in found:
        if kind == "tmp" or path in olds:
            _remove(path)
    return [os.path.basename(p) for _, p in found]


def commit(temp: str, target: str, token: str) -> None:
    """Rename ``temp`` to ``target``, replacing (and then removing) what was there."""
    old = f"{target}.old-{token}"
    had = os.path.lexists(target)
    if had:
        os.replace(target, old)
    try:
        os.replace(temp, target)  # the commit: from here `target` is the new directory
    except BaseException:
        if had:
            os.replace(old, target)
        raise
    fsync_directory(os.path.dirname(target))
    if had:
        _remove(old)
