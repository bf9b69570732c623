"""Shared test settings: which worlds exist on this machine.

Every multi-rank test runs its body through :func:`phalanx.testing.run_world`
on worlds of 1, 2 and 3 ranks for each backend available here (local, mpi,
gloo). A backend that is missing is skipped with the reason, never silently.
"""

from __future__ import annotations

import pytest

from phalanx.testing import available_backends

AVAILABLE = available_backends()

# (backend, ranks) pairs every collective test body runs on.
ALL_WORLDS = [("local", 1), ("mpi", 1), ("mpi", 2), ("mpi", 3), ("gloo", 1), ("gloo", 2), ("gloo", 3)]
# Multi-rank worlds for failure tests.
MULTI_WORLDS = [("mpi", 2), ("mpi", 3), ("gloo", 2), ("gloo", 3)]


def world_params(worlds: list[tuple[str, int]]) -> list[object]:
    params = []
    for backend, n in worlds:
        marks = [] if backend in AVAILABLE else [
            pytest.mark.skip(reason=f"backend {backend!r} is not available here (see `phalanx info`)")
        ]
        params.append(pytest.param(backend, n, id=f"{backend}-{n}", marks=marks))
    return params
