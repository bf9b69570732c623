"""Rank-aware output: ``phalanx.print`` and a logging setup where rank 0 speaks.

``phalanx.print`` is *not* collective (unlike FluxMPI's ``fluxmpi_println``,
which deadlocks when only some ranks call it): any rank may call it at any
time, and every line carries a ``[rank/size]`` prefix.
"""

from __future__ import annotations

import builtins
import logging
import sys
from typing import Any, TextIO

from . import _world
from ._world import current

__all__ = ["RankFilter", "print", "setup_logging"]


def print(*values: Any, sep: str = " ", end: str = "\n", file: TextIO | None = None,
          flush: bool = True) -> None:
    """Print from this rank with a ``[rank/size]`` prefix on every line, e.g. ``[1/4] step done``.

    Not collective: any rank may call it at any time, alone. Arguments are those of the
    built-in ``print``: ``values`` joined by ``sep`` and ended with ``end``, written to ``file``
    (default ``sys.stdout``); ``flush`` defaults to True so lines from different ranks are
    not held back in buffers.

    Raises :class:`~phalanx.NotInitializedError` before :func:`phalanx.init`.
    """
    world = current("print")
    text = sep.join(str(v) for v in values)
    prefix = f"[{world.rank}/{world.size}] "
    out = "\n".join(prefix + line for line in text.split("\n"))
    builtins.print(out, end=end, file=file if file is not None else sys.stdout, flush=flush)


class RankFilter(logging.Filter):
    """A :class:`logging.Filter` that passes records from rank 0 only, so a log is not repeated N times.

    ``all_ranks=True`` passes every rank's records; a single record opts in on every rank
    with ``logger.info(..., extra={"all_ranks": True})``. Before :func:`phalanx.init` every
    record passes. Also sets ``record.rank`` and ``record.size`` (``-1`` before init) for
    formats such as ``"[%(rank)d/%(size)d] %(message)s"``.
    """

    def __init__(self, all_ranks: bool = False) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        world = _world.current_or_none()
        record.rank = world.rank if world is not None else -1
        record.size = world.size if world is not None else -1
        if self.all_ranks or getattr(record, "all_ranks", False):
            return True
        return world is None or world.rank == 0


def setup_logging(level: int | str = logging.INFO, *, all_ranks: bool = False,
                  fmt: str = "%(asctime)s [%(rank)d/%(size)d] %(levelname)s %(name)s: %(message)s",
                  logger: logging.Logger | None = None) -> logging.Handler:
    """Send log records to stderr from rank 0 only, prefixed with ``[rank/size]``; returns the handler.

    Adds a stream handler with a :class:`RankFilter` to the root logger (or ``logger``)
    and sets its level, replacing a handler this function installed earlier, so calling
    it twice is safe.

    Arguments:
        ``level``: the logger's level (``logging.INFO`` or a name such as ``"DEBUG"``).
        ``all_ranks``: log from every rank, not only rank 0.
        ``fmt``: a :class:`logging.Formatter` format; ``%(rank)d`` and ``%(size)d`` are available.
        ``logger``: the logger to configure (default: the root logger).

    Returns the installed :class:`logging.Handler` (remove it with ``logger.removeHandler``).
    """
    target = logger if logger is not None else logging.getLogger()
    for old in [h for h in target.handlers if getattr(h, "_phalanx", False)]:
        target.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RankFilter(all_ranks))
    handler.setFormatter(logging.Formatter(fmt))
    handler._phalanx = True  # type: ignore[attr-defined]
    target.addHandler(handler)
    target.setLevel(level)
    return handler
