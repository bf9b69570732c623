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
    """``print`` with a ``[rank/size]`` prefix on every line; flushed by default."""
    world = current("print")
    text = sep.join(str(v) for v in values)
    prefix = f"[{world.rank}/{world.size}] "
    out = "\n".join(prefix + line for line in text.split("\n"))
    builtins.print(out, end=end, file=file if file is not None else sys.stdout, flush=flush)


class RankFilter(logging.Filter):
    """Pass records from rank 0 only (or every rank with ``all_ranks=True``).

    A single record can opt in on every rank with ``extra={"all_ranks": True}``.
    Adds ``record.rank`` and ``record.size`` for formats (``-1`` before init).
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
    """Log to stderr from rank 0 only (every rank with ``all_ranks=True``); returns the handler.

    Configures the root logger (or ``logger``), replacing a handler this function
    installed earlier, so calling it twice is safe.
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
