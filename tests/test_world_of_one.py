"""A world of one costs nothing: no gradient copied into a bucket, no collective in the step, and
the same parameters as plain torch (local, mpi and gloo at one rank)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import worlds_world_of_one as bodies  # noqa: E402
from conftest import world_params  # noqa: E402


@pytest.mark.parametrize("behaviour", bodies.ALONE.names)
@pytest.mark.parametrize("backend,n", world_params([("local", 1), ("mpi", 1), ("gloo", 1)]))
def test_a_world_of_one(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.alone, backend, n, behaviour)
