"""Named behaviours checked inside one world, each reported on its own.

A world costs seconds to start and a check microseconds, so one world runs
many checks; but the first failing ``assert`` must not hide the others, and
the pytest id must say what failed. So a worlds module declares its
behaviours by name at import time (pytest collects the names from it), the
world body runs them all and returns ``{name: None | failure text}``, and
the test side (``conftest.worlds``) turns each name into its own test id::

    # worlds_scalars.py (imported by pytest and by every rank)
    SCALARS = Behaviours()

    @SCALARS.behaviour("allreduce-of-int-returns-int")
    def _(r, n):
        assert phalanx.allreduce(r) == sum(range(n))

    def scalars():                          # the world body
        return SCALARS.run(phalanx.rank(), phalanx.size())

    # test_scalars.py
    @pytest.mark.parametrize("behaviour", bodies.SCALARS.names)
    @pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
    def test_scalars(worlds, backend, n, behaviour):
        worlds.check(bodies.scalars, backend, n, behaviour)

Behaviours run in the order they were declared, on every rank, so their
collectives line up across ranks. A behaviour that raises on one rank only
may leave its peers in a different collective; phalanx turns that into a
mismatch or timeout error in the next behaviour, which is then reported too
(bounded by the world's ``op_timeout``), never a hang.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["Behaviours"]


class Behaviours:
    """An ordered set of named checks; :meth:`run` runs them all and reports each."""

    def __init__(self) -> None:
        self._checks: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}

    @property
    def names(self) -> list[str]:
        """The behaviours' names, in the order they run (pytest ids)."""
        return list(self._checks)

    def add(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """Declare ``fn(*common, *args)`` as behaviour ``name`` (for checks generated in a loop)."""
        if name in self._checks:
            raise ValueError(f"behaviour {name!r} is declared twice")
        self._checks[name] = (fn, args)

    def behaviour(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator form of :meth:`add`."""
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add(name, fn)
            return fn
        return register

    def run(self, *common: Any, only: list[str] | None = None) -> dict[str, str | None]:
        """Run every behaviour (or those in ``only``) with ``common`` arguments first.

        Returns ``{name: None}`` for a behaviour that passed, else the failure
        with its traceback. Every behaviour runs even after one failed.
        """
        report: dict[str, str | None] = {}
        for name, (fn, args) in self._checks.items():
            if only is not None and name not in only:
                continue
            try:
                fn(*common, *args)
            except Exception as exc:  # reported by name; the next behaviour still runs
                report[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            else:
                report[name] = None
        return report
