"""Which world is this process's: the slot that ``phalanx.init`` fills and ``phalanx.shutdown`` empties.

The slot sits below :mod:`._world` so that a module the world itself imports
(the trace recorder, :mod:`._trace`, which needs the rank for ``start_trace``)
can read it without importing the world back. It holds a
:class:`phalanx._world.World`, typed ``Any`` here; :mod:`._world` gives these
functions their ``World`` types, and the modules above it import them from there.
"""

from __future__ import annotations

from typing import Any

from ._errors import NotInitializedError

__all__ = ["current", "current_or_none", "swap"]

_WORLD: Any = None  # the World that phalanx.init made, or None before it (and after shutdown)


def current_or_none() -> Any:
    """The initialized world, or ``None`` before ``phalanx.init`` (for code that works either way)."""
    return _WORLD


def swap(world: Any) -> Any:
    """Install ``world`` as this process's world and return the previous one (``init`` and
    ``shutdown`` use this, and benchmarks to time a second world side by side)."""
    global _WORLD
    previous, _WORLD = _WORLD, world
    return previous


def current(what: str) -> Any:
    """The initialized world, or NotInitializedError naming ``what``."""
    world = _WORLD
    if world is None:
        raise NotInitializedError(what)
    return world
